"""Reward assembly (the env's score plus components) and the tutorial presets."""
