"""The one exception type for mistakes a user can fix (bad file, bad option, wrong model).

The CLI prints its message on one line and exits with status 2; everything else is a bug
and keeps its traceback. Nothing else lives here.
"""


class UserError(Exception):
    """A problem in the user's input, named precisely enough to fix it."""
