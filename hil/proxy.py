"""The emulated broker: an MQTT-aware TCP proxy in front of a real broker that injects faults.

Each accepted connection is one `Session`: the first packet must be a CONNECT (its client id
names the session for fault rules and counters), then a connection to the upstream broker is
opened and packets flow through two `Link`s, up (client -> broker) and down (broker -> client).
Packets are framed and parsed with amqtt's MQTT 3.1.1 codec (`amqtt.mqtt`), so faults act per
message: a PUBLISH can be dropped or duplicated while the rest of the stream passes untouched.
Forwarded packets are the original bytes; only packets the proxy makes itself (a PUBACK for a
dropped message, the DUP flag of a copy) are encoded. A packet whose framing is intact but that the
codec cannot parse is still forwarded, as raw bytes without per-message faults (counted as
`unparsed`): judging it is the receiver's job, and a message the broker redelivers on every
reconnect must not cost the client every connection.

A link models a Wi-Fi hop on top of TCP: delays and bandwidth hold packets back, but never
reorder them (TCP does not either), and a dead link takes the whole connection with it. A link
that dies with a message in flight dies when that message's turn comes: what was sent before it
still arrives (the CONNACK, earlier messages and their acknowledgements), as on a real hop.
Otherwise a client with a backlog of queued messages could lose every connection before its
CONNACK and never get through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
from collections import Counter
from dataclasses import dataclass

from amqtt.adapters import BufferReader, StreamReaderAdapter
from amqtt.errors import AMQTTError, CodecError, MQTTError, NoDataError
from amqtt.mqtt import ConnectPacket, PubackPacket, PubcompPacket, PubrecPacket, packet_class
from amqtt.mqtt.packet import CONNECT, PUBACK, PUBLISH, PUBREL, MQTTFixedHeader

from hil.faults import EMPTY_CLIENT_ID, UNIDENTIFIED, Decision, FaultEngine, LinkFaults

log = logging.getLogger("hil.proxy")

MQTT_MAX_PACKET = 268_435_455 + 5  # the largest remaining length MQTT can express, plus the fixed header
CONNECT_TIMEOUT_S = 10.0
HIGH_WATER_BYTES = 4 * 1024 * 1024  # stop reading a side while this much waits in its link
SUPPORTED_PROTOCOLS = {("MQTT", 4), ("MQIsdp", 3)}  # MQTT 3.1.1 and 3.1; the fedal protocol uses 3.1.1


class Malformed(Exception):
    """Bytes that are not an MQTT packet the proxy can forward."""


class Unparsed(Malformed):
    """A complete packet (framing intact) that the codec cannot parse; `raw` can still be forwarded."""

    def __init__(self, message: str, raw: bytes, packet_type: int):
        super().__init__(message)
        self.raw = raw
        self.packet_type = packet_type


CUT = object()  # a link's queue item: the link dies here (what was queued before it is delivered)


@dataclass
class Packet:
    raw: bytes
    packet_type: int
    parsed: object

    @property
    def topic(self) -> str | None:
        return self.parsed.topic_name if self.packet_type == PUBLISH and self.parsed is not None else None

    @property
    def qos(self) -> int | None:
        return self.parsed.qos if self.packet_type == PUBLISH and self.parsed is not None else None

    @property
    def packet_id(self) -> int | None:
        vh = getattr(self.parsed, "variable_header", None)
        return getattr(vh, "packet_id", None)


async def read_packet(reader: asyncio.StreamReader, max_bytes: int = MQTT_MAX_PACKET) -> Packet | None:
    """The next packet from a stream, None at a clean end of stream; Malformed if it is not MQTT."""
    try:
        header = await MQTTFixedHeader.from_stream(StreamReaderAdapter(reader))
    except (MQTTError, CodecError, NoDataError) as exc:
        raise Malformed(f"bad fixed header: {exc}") from None
    if header is None:
        return None
    if header.bytes_length + header.remaining_length > max_bytes:
        raise Malformed(f"packet of {header.remaining_length} bytes is over the {max_bytes}-byte limit")
    try:
        body = await reader.readexactly(header.remaining_length)
    except asyncio.IncompleteReadError:
        raise Malformed(f"stream ended inside a packet ({header!r})") from None
    try:
        return await decode(header, body)
    except Malformed as exc:  # the framing held: the packet's bytes are known, only their meaning is not
        raise Unparsed(str(exc), header.to_bytes() + body, header.packet_type) from None


async def parse_bytes(data: bytes) -> list[Packet]:
    """Every packet in a byte string (tests and tools); Malformed on a partial or bad packet."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = []
    while (packet := await read_packet(reader)) is not None:
        out.append(packet)
    return out


async def decode(header: MQTTFixedHeader, body: bytes) -> Packet:
    """Parse a packet with amqtt's classes and check that they used exactly the packet's bytes."""
    try:
        cls = packet_class(header)
    except AMQTTError as exc:
        raise Malformed(str(exc)) from None
    if header.packet_type == CONNECT:  # before amqtt reads an MQTT 5 CONNECT's properties as its client id
        check_protocol(body)
    buf = BufferReader(body)
    try:
        parsed = await cls.from_stream(buf, fixed_header=header)
    except (AMQTTError, MQTTError, CodecError, NoDataError, ValueError, UnicodeError) as exc:
        raise Malformed(f"undecodable {cls.__name__}: {exc}") from None
    if header.packet_type != PUBLISH and buf._stream.tell() != len(body):  # PUBLISH's payload is the rest
        raise Malformed(f"{cls.__name__} has {len(body) - buf._stream.tell()} trailing bytes")
    if header.packet_type == PUBLISH:
        if parsed.qos not in (0, 1, 2):
            raise Malformed("PUBLISH with QoS 3")
        if parsed.qos and parsed.packet_id in (None, 0):
            raise Malformed("QoS>0 PUBLISH without a packet id")
    return Packet(header.to_bytes() + body, header.packet_type, parsed)


def check_protocol(body: bytes) -> None:
    """A CONNECT's protocol name and level, its first bytes in every MQTT version."""
    if len(body) < 2 or len(body) < 3 + (n := int.from_bytes(body[:2], "big")):
        raise Malformed("CONNECT too short for its protocol name and level")
    try:
        name = body[2:2 + n].decode()
    except UnicodeDecodeError:
        raise Malformed("CONNECT's protocol name is not UTF-8") from None
    level = body[2 + n]
    if (name, level) not in SUPPORTED_PROTOCOLS:
        version = {("MQTT", 5): " (MQTT 5)"}.get((name, level), "")
        raise Malformed(f"unsupported protocol {name!r} level {level}{version} (MQTT 3.1.1 or 3.1 only)")


def with_dup_flag(raw: bytes) -> bytes:
    """The same PUBLISH marked as a retransmission (DUP=1), as a client's resend looks."""
    return bytes([raw[0] | 0x08]) + raw[1:]


class Link:
    """One direction of one connection: delay, bandwidth and order, then the socket write."""

    def __init__(self, session: Session, direction: str, writer: asyncio.StreamWriter):
        self.session = session
        self.direction = direction
        self.writer = writer
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        self.link_free = 0.0
        self.last_due = 0.0
        self.pending_bytes = 0
        self.room = asyncio.Event()
        self.room.set()

    def send(self, data, faults: LinkFaults, delay_s: float) -> float:
        """Queue bytes (None: close after what is queued; CUT: end the session at this point, as a
        link dying with this message in flight); returns the added delay in seconds."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self.link_free)
        size = len(data) if isinstance(data, bytes) else 0
        tx = size * 8 / (faults.bandwidth_kbps * 1000) if faults.bandwidth_kbps > 0 else 0.0
        self.link_free = start + tx
        due = max(start + tx + delay_s, self.last_due)  # TCP keeps the order whatever the delays
        self.last_due = due
        self.pending_bytes += size
        if self.pending_bytes > HIGH_WATER_BYTES:
            self.room.clear()
        self.queue.put_nowait((due, data))
        return due - now

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await self.queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is CUT:  # what was written before the cut has left the proxy before the link dies
                deadline = loop.time() + 1.0
                while self.writer.transport.get_write_buffer_size() and loop.time() < deadline:
                    await asyncio.sleep(0.005)
                self.session.abort()
                return
            if data is None:  # the other side closed: flush, close this side too, end the session
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    self.writer.close()
                    await asyncio.wait_for(self.writer.wait_closed(), 5.0)
                self.session.abort()
                return
            self.writer.write(data)
            await self.writer.drain()
            self.pending_bytes -= len(data)
            if self.pending_bytes <= HIGH_WATER_BYTES:
                self.room.set()


class Session:
    """One client connection through the proxy."""

    def __init__(self, proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.proxy = proxy
        self.engine: FaultEngine = proxy.engine
        self.c_reader, self.c_writer = reader, writer
        self.u_writer: asyncio.StreamWriter | None = None
        self.client_id = UNIDENTIFIED
        self.peer = writer.get_extra_info("peername")
        self.links: dict[str, Link] = {}
        self.tasks: list[asyncio.Task] = []
        self.closed = asyncio.Event()
        # duplicated QoS 1 publishes get two PUBACKs: forward the first, swallow the copy's
        self.extra_acks: dict[str, Counter] = {"up": Counter(), "down": Counter()}
        self.acked_once: dict[str, set[int]] = {"up": set(), "down": set()}
        # QoS 2 publishes dropped in "lost" mode: the proxy completes their handshake itself
        self.swallowed_qos2: dict[str, set[int]] = {"up": set(), "down": set()}
        self.dying = False  # a cut is queued: the link dies when it comes due; no new faults until then

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # one connection's trouble never ends the proxy
            log.warning("session %s ended by %s: %s", self.client_id, type(exc).__name__, exc)
        finally:
            self.abort()

    async def _run(self) -> None:
        try:
            first = await asyncio.wait_for(read_packet(self.c_reader, self.proxy.max_packet_bytes), CONNECT_TIMEOUT_S)
        except Malformed as exc:
            self.engine.fault("malformed", UNIDENTIFIED, "up", peer=str(self.peer), reason=str(exc))
            return
        except TimeoutError:
            self.engine.fault("malformed", UNIDENTIFIED, "up", peer=str(self.peer),
                              reason=f"no complete CONNECT within {CONNECT_TIMEOUT_S:.0f} s")
            return
        except ConnectionError:
            return
        if first is None:
            return
        if first.packet_type != CONNECT:
            self.engine.fault("malformed", UNIDENTIFIED, "up", peer=str(self.peer),
                              reason=f"first packet is type {first.packet_type}, not CONNECT")
            return
        connect: ConnectPacket = first.parsed
        # an empty id is given a random one by the parser (client_id_is_random): one client that
        # reconnects would be a new one each time (new stats, a new fault stream, no rules)
        random_id = getattr(connect.payload, "client_id_is_random", False)
        self.client_id = EMPTY_CLIENT_ID if random_id or not connect.client_id else connect.client_id
        if self.engine.partitioned(self.client_id):
            self.engine.fault("refused", self.client_id, peer=str(self.peer))
            return
        try:
            u_reader, self.u_writer = await asyncio.wait_for(
                asyncio.open_connection(self.proxy.upstream_host, self.proxy.upstream_port), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s:%s unavailable for %s: %s", self.proxy.upstream_host, self.proxy.upstream_port,
                        self.client_id, exc)
            self.engine.count(self.client_id, "up", "upstream_unavailable")
            return
        self.engine.client(self.client_id).connections += 1
        self.proxy.sessions.add(self)
        log.info("client %s connected from %s", self.client_id, self.peer)
        self.links = {"up": Link(self, "up", self.u_writer), "down": Link(self, "down", self.c_writer)}
        if not self.handle("up", first):
            return
        self.tasks = [asyncio.create_task(self.links["up"].run()), asyncio.create_task(self.links["down"].run()),
                      asyncio.create_task(self.pump("up", self.c_reader)), asyncio.create_task(self.pump("down", u_reader))]
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if not isinstance(exc, (ConnectionError, OSError)):
                    log.warning("session %s: %s: %s", self.client_id, type(exc).__name__, exc)

    async def pump(self, direction: str, reader: asyncio.StreamReader) -> None:
        """Read packets from one side and hand them to the link towards the other side."""
        link = self.links[direction]
        while True:
            await link.room.wait()
            try:
                packet = await read_packet(reader, self.proxy.max_packet_bytes)
            except Unparsed as exc:
                self.engine.fault("malformed", self.client_id, direction, reason=str(exc), forwarded=True)
                if not self.forward_raw(direction, exc.raw):
                    return
                continue
            except Malformed as exc:
                self.engine.fault("malformed", self.client_id, direction, reason=str(exc))
                self.abort()
                return
            if packet is None:  # the sender closed: deliver what is queued, then close the other side
                link.send(None, LinkFaults(), 0.0)
                return
            if not self.handle(direction, packet):
                return

    def forward_raw(self, direction: str, raw: bytes) -> bool:
        """Relay a packet the codec cannot parse: delays and bandwidth apply, per-message faults do not."""
        engine, cid = self.engine, self.client_id
        engine.count(cid, direction, "packets")
        engine.count(cid, direction, "bytes", len(raw))
        engine.count(cid, direction, "unparsed")
        decision = engine.decide(cid, direction, None)
        if decision.reset and not self.dying:
            engine.fault("reset", cid, direction, type="unparsed")
            self.cut(direction, engine.link(cid, direction), decision.delay_s)
            return False
        self.links[direction].send(raw, engine.link(cid, direction), decision.delay_s)
        return True

    def cut(self, direction: str, faults: LinkFaults, delay_s: float) -> None:
        """The link dies when a message sent now would have arrived: what is ahead of it gets through,
        and the other direction keeps flowing until then (acknowledgements of what arrived)."""
        self.dying = True
        self.links[direction].send(CUT, faults, delay_s)

    def handle(self, direction: str, packet: Packet) -> bool:
        """Apply the faults to one packet; False once the connection is gone."""
        engine, cid = self.engine, self.client_id
        engine.count(cid, direction, "packets")
        engine.count(cid, direction, "bytes", len(packet.raw))
        other = "down" if direction == "up" else "up"
        if packet.packet_type == PUBACK and self._swallow_ack(direction, packet.packet_id):
            engine.count(cid, direction, "acks_swallowed")
            return True
        if packet.packet_type == PUBREL and packet.packet_id in self.swallowed_qos2[direction]:
            self.swallowed_qos2[direction].discard(packet.packet_id)
            self.links[other].send(PubcompPacket.build(packet.packet_id).to_bytes(), engine.link(cid, other), 0.0)
            return True
        decision: Decision = engine.decide(cid, direction, packet.topic, packet.qos)
        faults = engine.link(cid, direction)
        if self.dying:  # the link is already doomed: one death per connection, no faults stacked on it
            decision = Decision(decision.delay_s)
        if decision.eligible:
            engine.count(cid, direction, "eligible")
        details = {"type": type(packet.parsed).__name__}
        if packet.topic is not None:
            details.update(topic=packet.topic, qos=packet.qos, packet_id=packet.packet_id)
        if decision.drop:
            engine.count(cid, direction, "publishes")
            engine.fault("dropped", cid, direction, mode=faults.drop_mode, **details)
            if faults.drop_mode == "reset":
                self.cut(direction, faults, decision.delay_s)
                return False
            if faults.drop_mode == "lost" and packet.qos == 1:  # the sender's hop succeeded; the message did not
                self.links[other].send(PubackPacket.build(packet.packet_id).to_bytes(), engine.link(cid, other),
                                       engine.link(cid, other).latency_ms / 1000)
            elif faults.drop_mode == "lost" and packet.qos == 2:
                self.swallowed_qos2[direction].add(packet.packet_id)
                self.links[other].send(PubrecPacket.build(packet.packet_id).to_bytes(), engine.link(cid, other),
                                       engine.link(cid, other).latency_ms / 1000)
            return True
        if decision.reset:
            engine.fault("reset", cid, direction, **details)
            self.cut(direction, faults, decision.delay_s)
            return False
        if packet.topic is not None:
            engine.count(cid, direction, "publishes")
        delay = self.links[direction].send(packet.raw, faults, decision.delay_s)
        if delay > 0:
            engine.count(cid, direction, "delayed")
            engine.count(cid, direction, "delay_ms", round(delay * 1000))
        if decision.duplicate:
            engine.fault("duplicated", cid, direction, **details)
            copy = with_dup_flag(packet.raw) if packet.qos else packet.raw
            self.links[direction].send(copy, faults, decision.delay_s)
            if packet.qos == 1:
                self.extra_acks[other][packet.packet_id] += 1
        return True

    def _swallow_ack(self, direction: str, packet_id: int | None) -> bool:
        """True for the PUBACK of a copy the proxy made (the receiver acknowledges both)."""
        extra = self.extra_acks[direction]
        if packet_id is None or extra[packet_id] <= 0:
            return False
        seen = self.acked_once[direction]
        if packet_id not in seen:
            seen.add(packet_id)
            return False
        extra[packet_id] -= 1
        if extra[packet_id] <= 0:
            del extra[packet_id]
            seen.discard(packet_id)
        return True

    def abort(self) -> None:
        """Drop both TCP connections at once, as a dead link does (no DISCONNECT: the Will fires)."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.proxy.sessions.discard(self)
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()
        for w in (self.c_writer, self.u_writer):
            if w is not None:
                w.transport.abort()
        if self.client_id != UNIDENTIFIED:
            log.info("client %s disconnected", self.client_id)


class Proxy:
    """Listens for MQTT clients and relays each to the upstream broker through a Session."""

    def __init__(self, engine: FaultEngine, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 max_packet_bytes: int = MQTT_MAX_PACKET):
        self.engine = engine
        self.upstream_host, self.upstream_port = upstream
        self.listen_host, self.listen_port = listen
        self.max_packet_bytes = max_packet_bytes
        self.sessions: set[Session] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: dict[asyncio.Task, Session] = {}  # every connection, those before their CONNECT too
        self._watch: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self._watch = asyncio.create_task(self._enforce_partitions())
        return self

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._server is not None:
            self._server.close()
        for s in list(self.sessions) + list(self._tasks.values()):
            s.abort()
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=5)
            for t in stuck:  # e.g. a connection still waiting for its CONNECT
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(self, reader, writer)
        task = asyncio.current_task()
        self._tasks[task] = session
        try:
            await session.run()
        except asyncio.CancelledError:  # closing: asyncio's stream server would report a cancelled handler as an error
            return
        finally:
            self._tasks.pop(task, None)

    def reset_clients(self, pattern: str, reason: str = "api") -> int:
        """Cut every live connection whose client id matches `pattern` (fnmatch); how many."""
        cut = [s for s in list(self.sessions) if fnmatch.fnmatchcase(s.client_id, pattern)]
        for s in cut:
            self.engine.fault("reset", s.client_id, reason=reason)
            s.abort()
        return len(cut)

    async def _enforce_partitions(self, every_s: float = 0.05) -> None:
        """Cut live connections of clients whose partition has begun."""
        while True:
            await asyncio.sleep(every_s)
            for s in list(self.sessions):
                if self.engine.partitioned(s.client_id):
                    self.engine.fault("partition_cuts", s.client_id)
                    s.abort()
