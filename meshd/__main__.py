"""``meshd`` and ``python -m meshd``: the command line, without a traceback for Ctrl-C
(exit 130) or for a reader that went away (``meshd ps --json | head``: exit quietly)."""

import os
import sys

from . import ctrl_c


def _ctrl_c(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Ctrl-C, or an error the interpreter made of one: a KeyboardInterrupt
    raised while a class is being made (in a field's ``__set_name__``, as a module loads)
    comes out as a RuntimeError caused by it; one that lands while trio waits in a nursery
    (a connection being opened) comes out in an exception group."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        if isinstance(exc, BaseExceptionGroup):
            return exc.subgroup(lambda e: not isinstance(e, BaseExceptionGroup) and _ctrl_c(e)) is not None
        exc = exc.__cause__
    return False


def entry() -> None:
    # A shell starts a script's background job (``meshd run ... &``) with SIGINT ignored.
    # Once the node runs, SIGINT is its graceful leave whatever it inherited; so a SIGINT
    # that lands while it starts up ends it too (exit 130) instead of being lost, even
    # where Python swallows the KeyboardInterrupt (see ctrl_c).
    ctrl_c.install()
    try:
        from .cli import main  # inside the try: Ctrl-C can come while the modules load

        code = main()
        sys.stdout.flush()
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 141  # as a process SIGPIPE stopped
    except BaseException as exc:  # an error, or an exception group holding Ctrl-C
        if not _ctrl_c(exc):
            raise
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    entry()
