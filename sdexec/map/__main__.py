"""Run the mapper CLI: ``python -m sdexec.map --help``."""

from sdexec.map.cli import main

raise SystemExit(main())
