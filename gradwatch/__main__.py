"""``python -m gradwatch summary RUN_DIR``: the same as the ``gradwatch`` console script."""

from gradwatch.cli import main

raise SystemExit(main())
