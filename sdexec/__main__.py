"""``python3 -m sdexec``: the ``sdexec`` command (:mod:`sdexec.console`)."""

from sdexec.console import main

main()
