"""The agent's durable state on its workspace: atomic checkpoints and the task journal.

A checkpoint is the client's whole state (model, optimizer, generators, pending upload) and the
session's (last key, cached result, round, its steps); a crash mid-write leaves the previous one
intact. The journal holds, after one checkpoint, every task applied since, so a restarted agent
replays them from that checkpoint and reaches exactly the state it had: far fewer bytes written
than a checkpoint after every task (flash wear on an SD card), the same guarantees.

Journal file (`journal.bin`): a sequence of records, each

    u32 little-endian body length | u32 little-endian CRC-32 of the body | body

whose body is `u32 header length | header (JSON) | payload`. The first record's header is
`{"checkpoint": <id>}` (no payload): the journal belongs to the checkpoint with that id and to
no other, so a journal left behind by a crash between a new checkpoint and the journal's reset
is recognised as stale and ignored. Every further record is one applied task: header
`{"epoch", "seq", "result_sha256"}`, payload the task's whole envelope as received. A torn last
record (power cut mid-append) fails its length or CRC check and is dropped with everything after.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fedal.atomic import torch_save_atomic as save_atomic
from fedal.atomic import write_atomic

__all__ = ["save_atomic", "load", "save_checkpoint", "Journal", "JournalRecord", "JournalError"]

_FRAME = struct.Struct("<II")  # body length, CRC-32 of the body
_HEADER_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 31  # a length beyond this is a torn or corrupt frame, never a task


def load(path: Path) -> Any | None:
    """The checkpoint's content, or None if there is none. Only tensors and plain data are
    accepted (weights_only), so a tampered file cannot run code."""
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable before anything that depends on it is written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], path: Path, midway: Callable[[], None] | None = None) -> int:
    """Write `state` atomically and durably (file and directory fsync'd); returns the bytes
    written. `midway` runs after half the bytes are in the temporary file (the crash tests'
    hook: a write torn there must leave the previous checkpoint in force)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()

    def write(fh: BinaryIO) -> None:
        half = len(data) // 2
        fh.write(data[:half])
        if midway is not None:
            fh.flush()
            midway()
        fh.write(data[half:])

    write_atomic(path, write, private=True)
    fsync_dir(path.parent)
    return len(data)


class JournalError(ValueError):
    """A journal that cannot belong to the checkpoint it is read with."""


@dataclass(frozen=True)
class JournalRecord:
    key: tuple[int, int]
    payload: bytes
    result_sha256: str


def _frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    body = _HEADER_LEN.pack(len(head)) + head + payload
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _frames(data: bytes) -> Iterator[tuple[int, dict[str, Any], bytes]]:
    """(end offset, header, payload) of each intact record, stopping at the first torn one."""
    pos = 0
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if length < _HEADER_LEN.size or length > MAX_RECORD_BYTES or end > len(data):
            return
        body = data[start:end]
        if zlib.crc32(body) != crc:
            return
        (head_len,) = _HEADER_LEN.unpack_from(body)
        if _HEADER_LEN.size + head_len > len(body):
            return
        try:
            header = json.loads(body[_HEADER_LEN.size:_HEADER_LEN.size + head_len])
        except ValueError:
            return
        if not isinstance(header, dict):
            return
        yield end, header, body[_HEADER_LEN.size + head_len:]
        pos = end


def first_record_header(data: bytes) -> dict[str, Any] | None:
    """The header of the first intact record of a journal's bytes; None: not a journal's."""
    return next((header for _end, header, _payload in _frames(data)), None)


class Journal:
    """The append-only task journal of one checkpoint (see the module docstring for the format)."""

    def __init__(self, path: Path):
        self.path = path
        self._fh: BinaryIO | None = None
        self.checkpoint_id: str | None = None

    def reset(self, checkpoint_id: str) -> int:
        """Start the journal of checkpoint `checkpoint_id` (atomically replacing any other);
        returns the bytes written."""
        self.close()
        data = _frame({"checkpoint": checkpoint_id})
        write_atomic(self.path, lambda fh: fh.write(data), private=True)
        fsync_dir(self.path.parent)
        self.checkpoint_id = checkpoint_id
        return len(data)

    def read(self, checkpoint_id: str) -> tuple[list[JournalRecord], int]:
        """The records applied after checkpoint `checkpoint_id`, and the bytes of a torn tail
        that were dropped. A journal of another checkpoint (or none) has no records for it."""
        self.close()
        self.checkpoint_id = None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], 0
        frames = _frames(data)
        first = next(frames, None)
        if first is None or first[1].get("checkpoint") != checkpoint_id:
            return [], 0  # stale: left by a crash between a new checkpoint and the journal's reset
        good, records = first[0], []
        for end, header, payload in frames:
            try:
                key = (header["epoch"], header["seq"])
                digest = header["result_sha256"]
            except KeyError:
                break
            if not (type(key[0]) is int and type(key[1]) is int and isinstance(digest, str)):
                break
            records.append(JournalRecord(key, payload, digest))
            good = end
        torn = len(data) - good
        if torn:  # appends must follow the last intact record, not the torn bytes
            with open(self.path, "r+b") as fh:
                fh.truncate(good)
                os.fsync(fh.fileno())
        self.checkpoint_id = checkpoint_id
        return records, torn

    def append(self, key: tuple[int, int], payload: bytes, result_sha256: str) -> int:
        """Append one applied task, durably (flush + fsync) before its result may be sent;
        returns the bytes written."""
        if self.checkpoint_id is None:
            raise JournalError("the journal has no checkpoint to follow: reset() or read() it first")
        if self._fh is None:
            self._fh = open(self.path, "ab")
        data = _frame({"epoch": key[0], "seq": key[1], "result_sha256": result_sha256}, payload)
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return len(data)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
