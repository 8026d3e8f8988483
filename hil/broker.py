"""Start the emulated broker (proxy + control API): in the foreground for the CLI, or on a
background thread for Python test suites that drive real agents through it."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent.futures import Future

from hil.control import serve_control
from hil.faults import FaultEngine
from hil.profiles import Profile
from hil.proxy import MQTT_MAX_PACKET, Proxy

log = logging.getLogger("hil.broker")


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


async def start(profile: Profile, upstream: tuple[str, int], listen: tuple[str, int], control: tuple[str, int] | None,
                seed: int | None = None, max_packet_bytes: int = MQTT_MAX_PACKET):
    """The running proxy and, if asked for, the control API server and its port."""
    engine = FaultEngine(profile, seed=seed)
    proxy = await Proxy(engine, upstream, listen, max_packet_bytes=max_packet_bytes).start()
    server = task = None
    control_port = None
    if control is not None:
        try:
            server, task, control_port = await serve_control(proxy, *control)
        except BaseException:
            await proxy.close()
            raise
    return proxy, server, task, control_port


async def serve_forever(profile: Profile, upstream, listen, control, seed=None, on_ready=None) -> None:
    """The CLI's main: run until SIGINT/SIGTERM/SIGHUP, then close every connection."""
    proxy, server, task, control_port = await start(profile, upstream, listen, control, seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(proxy, control_port)
    await stop.wait()
    log.info("stopping: %s", proxy.engine.fault_counts)
    if server is not None:
        server.should_exit = True
        await task
    await proxy.close()


class EmulatedBroker:
    """The proxy on its own event loop thread. `with EmulatedBroker(profile, upstream) as b:`
    then point clients at `b.url`; `b.engine` holds the counters, `b.control_url` the API."""

    def __init__(self, profile: Profile, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 control: tuple[str, int] | None = ("127.0.0.1", 0), seed: int | None = None):
        self._args = (profile, upstream, listen, control, seed)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hil-broker", daemon=True)
        self.proxy: Proxy | None = None
        self._server = self._task = None
        self.control_port: int | None = None

    def start(self) -> EmulatedBroker:
        self._thread.start()
        try:
            self.proxy, self._server, self._task, self.control_port = self.call(start(*self._args))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            raise
        return self

    def call(self, coro, timeout: float = 30):
        """Run a coroutine on the proxy's loop and wait for its result."""
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def run(self, fn, *args):
        """Call a plain function on the proxy's loop (engine state belongs to that thread)."""
        async def _call():
            return fn(*args)
        return self.call(_call())

    @property
    def engine(self) -> FaultEngine:
        return self.proxy.engine

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.proxy.port}"

    @property
    def control_url(self) -> str | None:
        return None if self.control_port is None else f"http://127.0.0.1:{self.control_port}"

    def stop(self) -> None:
        async def _stop():
            if self._server is not None:
                self._server.should_exit = True
                await self._task
            await self.proxy.close()
        try:
            if self.proxy is not None:
                self.call(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def __enter__(self) -> EmulatedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
