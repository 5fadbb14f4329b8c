"""Evaluation during training: held-out sets scored on the engines with the current weights (``eval`` config)."""
