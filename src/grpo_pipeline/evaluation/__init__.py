"""Held-out evaluation and the best model."""
