"""Example environments and the loader that validates a user's env class."""
