"""Messages shared by the strategy halves, the agent and the coordinator."""

from fedal.protocol.envelope import PROTOCOL_VERSION, EnvelopeError, decode, encode, wire_size
from fedal.protocol.message import Message

__all__ = ["Message", "EnvelopeError", "PROTOCOL_VERSION", "decode", "encode", "wire_size"]
