"""The exception types that end a command with one line instead of a traceback.

:class:`UserError`: a mistake the user can fix (bad file, bad option, wrong model); the CLI
prints its message on one line and exits with status 2. :class:`Stopped`: training stopped on
request (SIGTERM, Ctrl-C) after saving what resuming needs; the CLI prints how to resume and
exits with the signal's conventional status (128 + its number). Everything else is a bug and
keeps its traceback. Nothing else lives here.
"""


class UserError(Exception):
    """A problem in the user's input, named precisely enough to fix it."""


class Stopped(Exception):
    """Training stopped on request at a step boundary; its checkpoint is saved (``saved``:
    where, or None when the task has nowhere to save) and ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, *, exit_code: int, saved: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.saved = saved
