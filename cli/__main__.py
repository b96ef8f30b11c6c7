"""``python -m murmura`` runs the same entry point as the ``murmura`` command."""

from murmura.cli import main

raise SystemExit(main())
