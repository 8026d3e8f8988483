"""The coordinator's own disconnect at shutdown is no broker failure: it is not logged as a
warning that says it reconnects (every orderly shutdown logged one per run)."""

from __future__ import annotations

import logging
import queue
import threading

from coordinator.bus import CoordinatorBus
from coordinator.config import CoordinatorBrokerSettings


def test_stopping_the_bus_is_not_a_reconnect_warning(mosquitto, caplog):
    bus = CoordinatorBus(CoordinatorBrokerSettings(url=mosquitto), "quiet", queue.Queue())
    with caplog.at_level(logging.INFO, logger="coordinator.mqtt"):
        assert bus.start(threading.Event(), warn_every_s=30)
        bus.stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "coordinator.mqtt"]
    assert (logging.INFO, "disconnected from the broker") in said, said
    assert not [m for level, m in said if level >= logging.WARNING], said
