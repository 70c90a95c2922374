"""The ``sdexec`` console script's entry point (and ``python3 -m sdexec``).

A ``sdexec run`` of the plain forms has its exec sent first
(:mod:`sdexec.earlyexec`): the unit starts while the rest of the command
line loads, which :func:`sdexec.cli.run_and_exit` then does.

A ^C while the command loads ends it quietly, with SIGINT's status, as one
after them does (:func:`sdexec.cli.main` forwards it from then on): under
Python's own handler it was a ``KeyboardInterrupt`` traceback through the
imports. (Once an early exec has gone, it is caught and kept for ``run``
instead, as the others it forwards are.) Set here, not in
:mod:`sdexec.cli`, whose importers (tests, ``scripts/gen_docs.py``) keep
their own ^C. A ^C the caller ignored
(``sdexec run JOB &`` in a script) stays ignored: Python leaves SIGINT
ignored then, and only its own handler is reset. The signal module's C
core, not the module: its enums would cost the early exec 3 ms.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
    from typing import NoReturn
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms


def main() -> NoReturn:
    """Run the ``sdexec`` command, ^C its default until it forwards it
    (unless the caller ignored it), a plain run's exec sent first."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from sdexec.earlyexec import send

    early = send(sys.argv[1:])
    from sdexec.cli import run_and_exit

    run_and_exit(early)
