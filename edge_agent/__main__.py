# `python -m edge_agent` is the edge-agent console script.
from edge_agent.cli import main

raise SystemExit(main())
