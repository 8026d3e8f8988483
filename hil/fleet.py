"""A fleet of emulated agents in one process, each with its own MQTT connection.

Every emulated agent is a real MQTT client of the broker (its own client id, persistent session,
Last Will, subscriptions), as a Pi would be. One thread drives all connections: paho clients in
external-loop mode (loop_read / loop_write / loop_misc on their sockets, multiplexed with
`selectors`), so a thousand clients cost a thousand sockets, not a thousand threads. Handling a
message is cheap (no model), so that single thread keeps up with a coordinator at scale.

paho reconnects by itself only in its own loop; here the fleet does it, with the agent's
exponential backoff (reconnect_min_s .. reconnect_max_s) and some jitter so that a thousand
clients do not all knock at once after a broker restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import selectors
import ssl
import threading
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from fedal.atomic import write_bytes_atomic
from fedal.protocol import DEFAULT_MAX_PAYLOAD, ManifestError, parse_broker_url, topics
from hil.emulated_agent import EmulatedAgent, ParsedManifest, PublicSetSource, Publish, parse_manifest
from mqtt_link.client import no_delay

log = logging.getLogger("hil.fleet")


def client_ids(n: int, prefix: str = "e") -> list[str]:
    width = max(4, len(str(n - 1)))
    return [topics.check_id(f"{prefix}{i:0{width}d}", "client id") for i in range(n)]


class _Conn:
    """One emulated agent and its paho client."""

    def __init__(self, fleet: Fleet, agent: EmulatedAgent):
        self.fleet = fleet
        self.agent = agent
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=agent.mqtt_client_id,
                                  clean_session=False, protocol=mqtt.MQTTv311)
        self.connected = False
        self.closing = False  # leaving for good: no reconnect
        self.next_attempt = 0.0
        self.backoff = fleet.reconnect_min_s
        self.sock = None
        self.waiting_writable = False
        c = self.client
        addr = fleet.address
        username, password = fleet.credentials.get(agent.client_id, (fleet.username, fleet.password))
        if username:
            c.username_pw_set(username, password)
        if addr.tls:
            c.tls_set(ca_certs=str(fleet.ca_file) if fleet.ca_file else None, cert_reqs=ssl.CERT_REQUIRED)
        will = agent.will()
        c.will_set(will.topic, will.payload, qos=1, retain=True)
        c.max_queued_messages_set(0)
        c.connect_async(addr.host, addr.port, keepalive=fleet.keepalive)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_socket_open = self._on_socket_open
        c.on_socket_close = self._on_socket_close
        c.on_socket_register_write = self._on_register_write
        c.on_socket_unregister_write = self._on_unregister_write

    # -- connection management (loop thread) -----------------------------------------------------
    def attempt(self, now: float) -> None:
        try:
            self.client.reconnect()
        except (OSError, ssl.SSLError) as exc:
            self.fleet.counters["connect_failures"] += 1
            self._schedule(now, f"cannot connect: {exc}")

    def _schedule(self, now: float, why: str) -> None:
        delay = self.backoff * random.uniform(0.8, 1.2)
        self.backoff = min(self.fleet.reconnect_max_s, self.backoff * 2)
        self.next_attempt = now + delay
        self.fleet.retry.add(self)
        log.debug("%s: %s; retrying in %.1f s", self.agent.client_id, why, delay)

    def publish(self, items: list[Publish]) -> None:
        for p in items:
            self.client.publish(p.topic, p.payload, qos=1, retain=p.retain)
            self.fleet.counters["published"] += 1

    # -- paho callbacks (loop thread) ----------------------------------------------------------
    def _on_socket_open(self, _c, _u, sock) -> None:
        no_delay(sock)  # as the real agent's client does (mqtt_link)
        self.sock = sock
        self.waiting_writable = False
        self.fleet.selector.register(sock, selectors.EVENT_READ, self)

    def _on_socket_close(self, _c, _u, sock) -> None:
        with contextlib.suppress(KeyError, ValueError):  # already unregistered, or the socket is closed
            self.fleet.selector.unregister(sock)
        self.sock = None

    def _on_register_write(self, _c, _u, _sock) -> None:
        self.fleet.to_write.add(self)  # written after this batch of events (a socket is nearly always writable)

    def _on_unregister_write(self, _c, _u, sock) -> None:
        if self.waiting_writable:
            self.waiting_writable = False
            self._select(sock, selectors.EVENT_READ)

    def flush(self) -> None:
        """Write what is queued; only if the socket cannot take it all, wait for it to be writable."""
        if self.sock is None:
            return
        self.client.loop_write()
        if self.sock is not None and self.client.want_write() and not self.waiting_writable:
            self.waiting_writable = True
            self._select(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _select(self, sock, events: int) -> None:
        with contextlib.suppress(KeyError, ValueError):  # the socket closed meanwhile: nothing to watch
            self.fleet.selector.modify(sock, events, self)

    def _on_connect(self, client, _u, _flags, reason_code, _props) -> None:
        if reason_code.is_failure:
            self.fleet.counters["refused"] += 1
            return  # paho closes the socket; _on_disconnect schedules the retry
        self.connected = True
        self.backoff = self.fleet.reconnect_min_s
        client.subscribe(self.agent.subscriptions())
        self.publish(self.agent.on_connected())

    def _on_disconnect(self, _c, _u, _flags, reason_code, _props) -> None:
        was = self.connected
        self.connected = False
        if was:
            self.fleet.counters["disconnects"] += 1
        if not self.closing and not self.fleet.stopping:
            self._schedule(time.monotonic(), f"disconnected ({reason_code})")

    def _on_message(self, _c, _u, message) -> None:
        self.fleet.counters["received"] += 1
        out = self.agent.on_message(message.topic, bytes(message.payload))
        self.publish(out)
        if self.agent.finished and self.fleet.exit_on_finish and not self.closing:
            self.fleet.leave(self)


class Fleet:
    """N emulated agents of one run on one broker, driven by one thread."""

    def __init__(self, broker_url: str, run_id: str, ids: list[str], seed: int = 0, *, username: str | None = None,
                 password: str | None = None, ca_file: str | Path | None = None, keepalive: int = 30,
                 reconnect_min_s: float = 1.0, reconnect_max_s: float = 30.0, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 public_file: str | Path | None = None, exit_on_finish: bool = True, connects_per_tick: int = 100,
                 credentials: dict[str, tuple[str, str | None]] | None = None, models: list[str] | None = None,
                 input_shape: tuple[int, ...] | None = None):
        """credentials: per client id (username, password), e.g. from `fedal fleet init` (see
        device_credentials); clients not in it use username/password or the URL's. models,
        input_shape: the zoo models the emulated weights take the layout of (EmulatedAgent): the
        coordinator's, for a FedAvg-type run whose global model it scores."""
        self.address = parse_broker_url(broker_url)
        self.credentials = dict(credentials or {})
        self.run_id = topics.check_id(run_id, "run id")
        self.username = username or self.address.username
        self.password = password or self.address.password
        self.ca_file = ca_file
        self.keepalive = keepalive
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.exit_on_finish = exit_on_finish
        self.connects_per_tick = connects_per_tick
        self.counters: Counter[str] = Counter()
        self.public = PublicSetSource(Path(public_file) if public_file else None)
        parser = _shared_parser()  # one parse of each manifest for the whole fleet
        self.agents = [EmulatedAgent(run_id, cid, index=i, seed=seed, public=self.public, max_payload=max_payload,
                                     manifest_parser=parser, models=models, input_shape=input_shape)
                       for i, cid in enumerate(ids)]
        self.selector = selectors.DefaultSelector()
        self.conns: list[_Conn] = []
        self.retry: set[_Conn] = set()
        self.to_write: set[_Conn] = set()
        self.leaving: list[tuple[_Conn, Any, float]] = []
        self.stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-loop", daemon=True)
        self.error: BaseException | None = None
        self.lock = threading.RLock()
        self.started_at: float | None = None

    # -- control (any thread) --------------------------------------------------------------------
    def start(self) -> Fleet:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Say goodbye (retained offline, then DISCONNECT), like an agent on SIGTERM."""
        self._stop.set()
        self._thread.join(timeout_s + 5)

    def kill(self) -> None:
        """Drop every connection without DISCONNECT: the broker publishes the Last Wills."""
        self.stopping = True
        self._stop.set()
        self._thread.join(10)

    def online(self) -> int:
        return sum(c.connected for c in self.conns)

    def finished(self) -> bool:
        return all(a.finished for a in self.agents)

    def wait_finished(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.finished():
                return True
            if not self._thread.is_alive():
                return self.finished()
            time.sleep(0.1)
        return self.finished()

    def wait_online(self, n: int | None = None, timeout_s: float = 60.0) -> bool:
        n = len(self.agents) if n is None else n
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.online() >= n:
                return True
            time.sleep(0.05)
        return False

    def totals(self) -> Counter[str]:
        """The agents' counters summed (tasks, duplicates, stale, rejected, feedback_applied, ...)."""
        out: Counter[str] = Counter()
        with self.lock:
            for a in self.agents:
                out.update(a.counters)
        return out

    def summary(self) -> dict[str, Any]:
        """Totals over the fleet, and every agent's own status (like agent-status.json)."""
        totals: Counter[str] = Counter()
        per_client = {}
        with self.lock:
            for a in self.agents:
                s = a.status()
                totals.update(s["counters"])
                per_client[a.client_id] = s
            transport = dict(self.counters)
        twice = {cid: s["feedback_twice"] for cid, s in per_client.items() if s["feedback_twice"]}
        twice_iter = {cid: s["iterations_twice"] for cid, s in per_client.items() if s["iterations_twice"]}
        return {
            "run_id": self.run_id, "clients": len(self.agents), "online": self.online(),
            "finished": sum(a.finished for a in self.agents), "transport": transport,
            "counters": dict(totals), "feedback_applied": sum(s["feedback_applied"] for s in per_client.values()),
            "feedback_applied_twice": twice, "iterations_applied_twice": twice_iter,
            "public_set_fetches": self.public.fetches, "error": repr(self.error) if self.error else None,
            "per_client": per_client,
        }

    def write_status(self, path: str | Path) -> None:
        """Replaced whole (fedal.atomic: a temporary name of its own beside it, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, json.dumps({**self.summary(), "ts": time.time()}, indent=1).encode())

    # -- the loop ----------------------------------------------------------------------------------
    def leave(self, conn: _Conn) -> None:
        """An agent whose run finished leaves like the real one: offline status, then DISCONNECT."""
        conn.closing = True
        self.retry.discard(conn)
        if conn.connected:
            bye = conn.agent.goodbye()
            info = conn.client.publish(bye.topic, bye.payload, qos=1, retain=True)
            self.leaving.append((conn, info, time.monotonic() + 5))
        else:
            conn.client.disconnect()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported in summary(); the test or CLI sees it
            self.error = exc
            log.exception("fleet loop failed")
        finally:
            self.selector.close()

    def _loop(self) -> None:
        todo = list(self.agents)
        last_misc = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            with self.lock:
                for _ in range(min(self.connects_per_tick, len(todo))):  # ramp up: no SYN storm
                    conn = _Conn(self, todo.pop(0))
                    self.conns.append(conn)
                    conn.attempt(now)
                self._flush()
            self._poll(0.02 if todo else 0.05)
            now = time.monotonic()
            if now - last_misc >= 0.25:
                last_misc = now
                with self.lock:
                    self._housekeeping(now)
                    self._flush()
        if not self.stopping:
            self._goodbye()
        for conn in self.conns:
            if conn.sock is not None:
                conn.client._sock_close()  # noqa: SLF001 - no DISCONNECT: the Will is published (kill)

    def _poll(self, timeout: float) -> None:
        events = self.selector.select(timeout)
        with self.lock:  # readers of the agents' state (summary) see no half-handled message
            for key, mask in events:
                conn: _Conn = key.data
                if key.fileobj is not conn.sock:
                    continue  # closed while handling an earlier event of this batch
                c = conn.client
                if mask & selectors.EVENT_READ:
                    c.loop_read()
                if mask & selectors.EVENT_WRITE and conn.sock is not None:
                    c.loop_write()
            self._flush()

    def _flush(self) -> None:
        while self.to_write:
            pending, self.to_write = self.to_write, set()
            for conn in pending:
                conn.flush()

    def _housekeeping(self, now: float) -> None:
        for conn in self.conns:
            if conn.sock is not None:
                conn.client.loop_misc()  # keepalive pings
            if conn.connected:
                out = conn.agent.tick(now)
                if out:
                    conn.publish(out)
        for conn in [c for c in self.retry if c.next_attempt <= now]:
            self.retry.discard(conn)
            if not conn.closing:
                conn.attempt(now)
        still = []
        for conn, info, deadline in self.leaving:
            if info.is_published() or now >= deadline or not conn.connected:
                conn.client.disconnect()
            else:
                still.append((conn, info, deadline))
        self.leaving = still

    def _goodbye(self, timeout_s: float = 5.0) -> None:
        infos = []
        for conn in self.conns:
            if conn.connected and not conn.closing:
                conn.closing = True
                bye = conn.agent.goodbye()
                infos.append((conn, conn.client.publish(bye.topic, bye.payload, qos=1, retain=True)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(i.is_published() or not c.connected for c, i in infos):
            self._poll(0.05)
        for conn in self.conns:
            conn.closing = True
            if conn.sock is not None:
                conn.client.disconnect()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(c.sock is not None and c.client.want_write() for c in self.conns):
            self._poll(0.05)


def device_credentials(devices_dir: str | Path, ids: list[str]) -> dict[str, tuple[str, str | None]]:
    """(username, password) of each device from `fedal fleet init`'s devices/<id>/agent.toml."""
    import tomllib

    out = {}
    for cid in ids:
        path = Path(devices_dir) / cid / "agent.toml"
        try:
            broker = tomllib.loads(path.read_text(encoding="utf-8")).get("broker", {})
        except (OSError, ValueError, RecursionError) as exc:  # (TOMLDecodeError, UnicodeDecodeError: ValueErrors)
            raise ValueError(f"no credentials for {cid}: {path}: {exc}") from None
        if not isinstance(broker, dict) or not isinstance(broker.get("username"), str) or not broker["username"]:
            raise ValueError(f"{path} has no [broker] username")
        password = broker.get("password")
        if password is not None and not isinstance(password, str):
            raise ValueError(f"{path}: [broker] password is not text")
        out[cid] = (broker["username"], password)
    return out


def _shared_parser():
    """parse_manifest memoised by payload: each agent gets the same answer (or the same error)."""

    @lru_cache(maxsize=8)
    def cached(payload: bytes) -> ParsedManifest | str:
        try:
            return parse_manifest(payload)
        except ManifestError as exc:
            return str(exc)

    def parse(payload: bytes) -> ParsedManifest:
        out = cached(bytes(payload))
        if isinstance(out, str):
            raise ManifestError(out)
        return out

    return parse
