"""The two error types every user-facing failure is raised as.

Each message says what is wrong and how to fix it; the CLI prints it on one line and
exits with code 2, so nothing here should ever surface as a traceback.
"""


class ModelcarveError(ValueError):
    """Base of all errors the CLI reports as one line on stderr (exit code 2)."""


class SpecError(ModelcarveError):
    """A model, device, link or cluster description is malformed or unknown."""


class LayoutError(ModelcarveError):
    """A parallel layout is malformed or cannot be applied to this model and cluster."""
