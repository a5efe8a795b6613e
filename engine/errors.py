"""Errors the engine raises for problems a user can fix (bad model directory, bad input)."""


class ModelLoadError(ValueError):
    """A model directory cannot be used: missing file, unsupported architecture, wrong tensor shape.

    The message names the file (and tensor) at fault, so it can be shown to the user as is.
    """


class EnginesDidNotStart(RuntimeError):
    """No worker process (or actor) could build its engine: the model does not load there. The message says why
    for each worker."""


class InvalidOption(ValueError):
    """A run option that cannot be used as given (engine/run/config.py); the message names the option."""
