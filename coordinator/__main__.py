"""python -m coordinator --config coordinator.toml"""

from coordinator.cli import main

raise SystemExit(main())
