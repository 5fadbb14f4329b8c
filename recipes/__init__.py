"""Training recipes launched by run.py."""
