"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class LlmaccelError(ValueError):
    """A problem with the user's input (model, option, file, argument), not a bug. A ValueError,
    so that code catching bad values of any origin catches these too."""


def require_extra(module: str, extra: str, what: str):
    """Import and return `module`, an optional dependency that `extra` installs. Where it is
    missing, `what` (the command or code path) fails with one line naming the extra, rather than
    an ImportError deep in a traceback; a core install runs everything else."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LlmaccelError(f"{what} needs the {extra} extra ({e.name or module} is missing): "
                            f"pip install 'llmaccel[{extra}]'") from None
