"""python -m edge_agent --config agent.toml"""

from edge_agent.cli import main

raise SystemExit(main())
