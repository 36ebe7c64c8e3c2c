"""Errors that are the user's to fix: reported as one line that names the key, file or line, never as a
traceback."""


class UserError(Exception):
    """A problem with the configuration or the data, with a message that says what to change."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class NumericalError(UserError):
    """NaN or infinite losses or gradients beyond what trainer.on_nonfinite allows."""
