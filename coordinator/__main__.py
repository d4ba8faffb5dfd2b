# `python -m coordinator` is the fl-coordinator console script.
from coordinator.cli import main

raise SystemExit(main())
