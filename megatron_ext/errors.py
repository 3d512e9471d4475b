class ConfigError(ValueError):
    """A bad flag or recipe value, reported before any compute starts.
    The message names the flag (``--flag-name=value``) and what is wrong."""
