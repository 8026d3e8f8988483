"""The broker a benchmark's processes talk through: a private Mosquitto on a loopback port
(hil.mosquitto) where it is installed, else the toolkit's embedded broker."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def loopback_broker(workdir: Path) -> Iterator[tuple[str, str]]:
    """Yields (broker URL, broker name) and stops the broker afterwards."""
    from hil.mosquitto import Mosquitto, free_port

    try:
        mosquitto = Mosquitto(Path(workdir) / "mosquitto", max_queued_messages=100_000)
    except FileNotFoundError:
        from coordinator.broker import EmbeddedBroker

        embedded = EmbeddedBroker(port=free_port()).start()
        try:
            yield embedded.url, "embedded amqtt"
        finally:
            embedded.stop()
        return
    with mosquitto:
        yield mosquitto.url, "mosquitto"
