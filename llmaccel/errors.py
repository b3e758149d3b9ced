"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class LlmaccelError(ValueError):
    """A problem with the user's input (model, option, file, argument), not a bug. A ValueError,
    so that code catching bad values of any origin catches these too."""
