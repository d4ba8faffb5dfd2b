# `python -m export` is the fl-export console script.
from export.cli import main

raise SystemExit(main())
