"""Model assets: the locally generated tiny stand-ins of every family and checkpoint checks."""
