"""The dashboard: static HTML/JS served by the coordinator, fed by the REST API and the SSE stream.

No build step: plain modules and a vendored copy of uPlot (MIT) for the curves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.responses import Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")

# Every file of the dashboard: revalidated on each load (a browser's heuristic cache ran a stale
# app.js after an upgrade), its own scripts and styles only, in no other site's frame.
DASHBOARD_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class DashboardFiles(StaticFiles):
    """The dashboard's files, with DASHBOARD_HEADERS."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(DASHBOARD_HEADERS)
        return response


def dashboard_files() -> DashboardFiles:
    return DashboardFiles(directory=STATIC_DIR, html=True)
