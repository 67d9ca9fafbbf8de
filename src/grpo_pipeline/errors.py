"""Errors that end a run with one clear message (no traceback by default)."""


class PipelineError(Exception):
    """A problem the user can fix; the message names the key, class or row and the fix."""


class ConfigError(PipelineError):
    """Bad configuration, caught before any weights load."""


class EnvError(PipelineError):
    """The user's environment failed or returned a bad score."""
