"""The one exception of a configuration mistake, in a module of its own so every config module can raise it."""


class ConfigError(ValueError):
    """A user's configuration mistake; the message is one line."""
