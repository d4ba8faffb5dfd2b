# `python -m bench` is the fl-bench console script.
from bench.cli import main

raise SystemExit(main())
