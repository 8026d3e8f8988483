"""python -m hil broker --upstream mqtt://127.0.0.1:1883 --listen 127.0.0.1:1884 --profile wifi-lossy"""

from hil.cli import main

raise SystemExit(main())
