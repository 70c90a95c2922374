"""The ``sdexec`` console script's entry point.

A ^C while the command loads (its imports are a fifth of its start-up)
ends it quietly, with SIGINT's status, as one after them does
(:func:`sdexec.cli.main` forwards it from then on): under Python's own
handler it was a ``KeyboardInterrupt`` traceback through the imports. Set
here, not in :mod:`sdexec.cli`, whose importers (tests,
``scripts/gen_docs.py``) keep their own ^C. A ^C the caller ignored
(``sdexec run JOB &`` in a script) stays ignored: Python leaves SIGINT
ignored then, and only its own handler is reset.
"""

from __future__ import annotations

import signal
from typing import NoReturn


def main() -> NoReturn:
    """Run the ``sdexec`` command, ^C its default until it forwards it
    (unless the caller ignored it)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from sdexec.cli import run_and_exit

    run_and_exit()
