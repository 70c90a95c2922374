"""Run the mapper CLI: ``python3 -m sdexec.map --help``."""

from sdexec.map.cli import main

raise SystemExit(main())
