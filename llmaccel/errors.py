"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class LlmaccelError(Exception):
    """A problem with the user's input (model, option, file), not a bug."""
