"""Messages, their wire envelope, chunking, topics and the run manifest.

Shared by the strategy halves, the agent and the coordinator; no network code lives here.
"""

from fedal.protocol import topics
from fedal.protocol.broker_url import MAX_PAYLOAD, BrokerAddress, BrokerSettings, parse_broker_url
from fedal.protocol.chunking import DEFAULT_MAX_PAYLOAD, MAX_MESSAGE_BYTES, ChunkError, Reassembler, ReassemblyLimitError, split
from fedal.protocol.envelope import PROTOCOL_VERSION, EnvelopeError, carried, decode, encode, wire_size
from fedal.protocol.manifest import ManifestError, RunManifest
from fedal.protocol.message import TASK_CONTEXT, Message, answering
from fedal.protocol.packet import Packet
from fedal.protocol.validation import DEFAULT_MAX_ABS_VALUE, tensor_problem

__all__ = [
    "BrokerAddress",
    "BrokerSettings",
    "ChunkError",
    "DEFAULT_MAX_ABS_VALUE",
    "DEFAULT_MAX_PAYLOAD",
    "EnvelopeError",
    "MAX_PAYLOAD",
    "MAX_MESSAGE_BYTES",
    "ManifestError",
    "Message",
    "answering",
    "carried",
    "Packet",
    "PROTOCOL_VERSION",
    "Reassembler",
    "ReassemblyLimitError",
    "RunManifest",
    "TASK_CONTEXT",
    "decode",
    "encode",
    "parse_broker_url",
    "split",
    "tensor_problem",
    "topics",
    "wire_size",
]
