"""``meshd`` and ``python -m meshd``: the command line, without a traceback for Ctrl-C
(exit 130) or for a reader that went away (``meshd ps --json | head``: exit quietly)."""

import os
import sys


def entry() -> None:
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
    sys.exit(code)


if __name__ == "__main__":
    entry()
