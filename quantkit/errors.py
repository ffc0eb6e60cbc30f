"""The one exception type for mistakes a user can fix (bad input, missing files)."""


class QuantkitError(Exception):
    """A problem with the user's input. The message is one sentence saying what was
    wrong and what to do; the CLI prints it without a traceback and exits 2."""
