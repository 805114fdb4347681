"""The exception types that end a command with one line instead of a traceback.

:class:`UserError`: a mistake the user can fix (bad file, bad option, wrong model); the CLI
prints its message on one line and exits with status 2. :class:`OptionError`: a UserError
about options of a library call, named as the library spells them (``ctc_weight``), which an
adapter names as its flags (``--ctc-weight``). :class:`Stopped`: training stopped on request
(SIGTERM, Ctrl-C) after saving what resuming needs; the CLI prints how to resume and exits with
the signal's conventional status (128 + its number). Everything else is a bug and keeps its
traceback. Nothing else lives here.
"""

import re
from collections.abc import Mapping


class UserError(Exception):
    """A problem in the user's input, named precisely enough to fix it."""


class OptionError(UserError):
    """A UserError about keyword options of a library call: ``options`` are their names as the
    library spells them (``ctc_weight``), each named so in the message. The library names the
    problem, never a command's flag; an adapter with flags names them its way (:meth:`said`)."""

    def __init__(self, message: str, *options: str) -> None:
        super().__init__(message)
        self.options = options

    def said(self, flags: Mapping[str, str]) -> str:
        """The message with each option named by its flag: ``flags[option]``, else the option
        with dashes (``ctc_weight`` -> ``--ctc-weight``). One pass, whole words only, and never
        inside a path (``runs/lm`` stays)."""
        if not self.options:
            return str(self)
        names = sorted(self.options, key=len, reverse=True)  # lm_weight before lm
        pattern = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, names)) + r")(?![\w/-])")
        return pattern.sub(lambda m: flags.get(m.group(), "--" + m.group().replace("_", "-")), str(self))


class Stopped(Exception):
    """Training stopped on request at a step boundary; its checkpoint is saved (``saved``:
    where, or None when the task has nowhere to save) and ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, *, exit_code: int, saved: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.saved = saved
