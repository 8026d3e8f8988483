"""Messages, their wire envelope, chunking, topics and the run manifest.

Shared by the strategy halves, the agent and the coordinator; no network code lives here.
"""

from fedal.protocol import topics
from fedal.protocol.broker_url import BrokerAddress, BrokerSettings, parse_broker_url
from fedal.protocol.chunking import DEFAULT_MAX_PAYLOAD, Reassembler, split
from fedal.protocol.envelope import PROTOCOL_VERSION, EnvelopeError, decode, encode, wire_size
from fedal.protocol.manifest import ManifestError, RunManifest
from fedal.protocol.message import Message

__all__ = [
    "BrokerAddress",
    "BrokerSettings",
    "DEFAULT_MAX_PAYLOAD",
    "EnvelopeError",
    "ManifestError",
    "Message",
    "PROTOCOL_VERSION",
    "Reassembler",
    "RunManifest",
    "decode",
    "encode",
    "parse_broker_url",
    "split",
    "topics",
    "wire_size",
]
