"""The dashboard: static HTML/JS served by the coordinator, fed by the REST API and the SSE stream.

No build step: plain modules and a vendored copy of uPlot (MIT) for the curves.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).with_name("static")
