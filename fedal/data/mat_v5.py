"""Check a MATLAB v5 .mat file of numeric arrays (SVHN's X and y) before scipy reads it.

scipy's v5 reader looks a data element's type up in a fixed table without a bounds check: one
damaged byte (a type code, or a complex flag that sends it reading past its variable into the
next one's header) crashes the whole process with SIGSEGV or SIGBUS, where no `except` can turn
it into an error that names the file. This walks the file as the reader will (compressed
variables inflated as a stream, nothing kept) and, as ValueError, refuses anything but plain
numeric arrays whose every element has a known type and fits its variable.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import BinaryIO

MI_INT8, MI_INT32, MI_UINT32, MI_MATRIX, MI_COMPRESSED, MI_UTF8 = 1, 5, 6, 14, 15, 16
# the numeric data types the format defines (8, 10 and 11 are reserved)
NUMERIC_TYPES = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 12, 13})
NUMERIC_CLASSES = frozenset(range(6, 16))  # mxDOUBLE_CLASS .. mxUINT64_CLASS
COMPLEX_FLAG = 0x800
MAX_DIMS = 32
HEADER_BYTES = 128
CHUNK = 1 << 20


class _Inflated:
    """The bytes of one compressed variable, inflated as they are read."""

    def __init__(self, fh: BinaryIO, nbytes: int):
        self.fh, self.left = fh, nbytes
        self.inflate = zlib.decompressobj()
        self.buffer = b""

    def _more(self) -> bool:
        while True:
            if self.inflate.unconsumed_tail:
                data = self.inflate.unconsumed_tail
            elif self.left > 0 and not self.inflate.eof:
                data = self.fh.read(min(CHUNK, self.left))
                if not data:
                    raise ValueError("the file ends inside a compressed variable")
                self.left -= len(data)
            else:
                return False
            try:
                out = self.inflate.decompress(data, CHUNK)
            except zlib.error as exc:
                raise ValueError(f"a compressed variable does not inflate ({exc})") from None
            if out:
                self.buffer += out
                return True

    def read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._more():
                break
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def skip(self, n: int) -> int:
        skipped = 0
        while skipped < n:
            if not self.buffer and not self._more():
                break
            take = min(n - skipped, len(self.buffer))
            self.buffer = self.buffer[take:]
            skipped += take
        return skipped


class _Plain:
    def __init__(self, fh: BinaryIO):
        self.fh = fh

    def read(self, n: int) -> bytes:
        return self.fh.read(n)

    def skip(self, n: int) -> int:
        start = self.fh.tell()
        end = self.fh.seek(0, 2)
        self.fh.seek(min(start + n, end))
        return min(n, end - start)


class _Variable:
    """The sub-elements of one variable (a miMATRIX of `nbytes`), read in order."""

    def __init__(self, stream: _Plain | _Inflated, order: str, nbytes: int):
        self.stream, self.order, self.left = stream, order, nbytes

    def element(self, what: str, types: frozenset[int], keep: int = 0) -> tuple[int, bytes]:
        """(its type, its first `keep` bytes) of the next element, which must be one of `types`."""
        if self.left < 8:
            raise ValueError(f"a variable ends before its {what}")
        tag = self.stream.read(8)
        if len(tag) < 8:
            raise ValueError("the file ends inside a variable")
        self.left -= 8
        first, second = struct.unpack(self.order + "II", tag)
        if first >> 16:  # a small element: type, size and up to 4 bytes of data in these 8 bytes
            kind, nbytes, data = first & 0xFFFF, first >> 16, tag[4:]
            if nbytes > 4:
                raise ValueError(f"a small data element claims {nbytes} bytes (at most 4)")
        else:
            kind, nbytes, data = first, second, b""
        if kind not in types:
            raise ValueError(f"the {what} of a variable has data type {kind} (a damaged file, or "
                             "not an array of numbers)")
        if first >> 16:
            return kind, data[:min(keep, nbytes)]
        padded = nbytes + -nbytes % 8
        if padded > self.left:
            raise ValueError(f"a variable's {what} takes {nbytes} bytes, where {self.left} are left in it")
        data = self.stream.read(min(keep, nbytes))
        if len(data) < min(keep, nbytes) or self.stream.skip(padded - len(data)) < padded - len(data):
            raise ValueError("the file ends inside a variable")
        self.left -= padded
        return kind, data


def check_numeric_mat_v5(path: Path) -> None:
    """ValueError unless the v5 variables in `path` are numeric arrays scipy reads safely."""
    with open(path, "rb") as fh:
        header = fh.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise ValueError("shorter than a MAT v5 header")
        order = {b"IM": "<", b"MI": ">"}.get(header[126:128])
        if order is None:
            raise ValueError("no MAT v5 byte-order mark")
        left = fh.seek(0, 2) - HEADER_BYTES
        fh.seek(HEADER_BYTES)
        plain = _Plain(fh)
        while left > 0:
            tag = fh.read(8)
            if len(tag) < 8:
                raise ValueError("a variable's tag is cut short")
            kind, nbytes = struct.unpack(order + "II", tag)
            if nbytes > left - 8:
                raise ValueError(f"a variable of {nbytes} bytes in the {left - 8} left of the file")
            start = fh.tell()
            if kind == MI_MATRIX:
                _check_array(_Variable(plain, order, nbytes))
            elif kind == MI_COMPRESSED:
                inflated = _Inflated(fh, nbytes)
                inner = inflated.read(8)
                if len(inner) < 8:
                    raise ValueError("a compressed variable holds no variable")
                kind, size = struct.unpack(order + "II", inner)
                if kind != MI_MATRIX:
                    raise ValueError(f"a compressed variable holds data type {kind}, not a variable")
                _check_array(_Variable(inflated, order, size))
            else:
                raise ValueError(f"a top-level data element of type {kind}, not a variable")
            fh.seek(start + nbytes)
            left -= 8 + nbytes


def _check_array(var: _Variable) -> None:
    """Array flags, dimensions, name, real part and (flagged complex) imaginary part: nothing else."""
    _, flags = var.element("array flags", frozenset({MI_UINT32}), keep=8)
    if len(flags) < 8:
        raise ValueError("a variable's array flags are cut short")
    word = struct.unpack(var.order + "I", flags[:4])[0]
    if word & 0xFF not in NUMERIC_CLASSES:
        raise ValueError(f"a variable of class {word & 0xFF}, not an array of numbers")
    _, dims = var.element("dimensions", frozenset({MI_INT32, MI_UINT32}), keep=4 * MAX_DIMS + 1)  # (as scipy takes)
    if not 8 <= len(dims) <= 4 * MAX_DIMS or len(dims) % 4:
        raise ValueError(f"a variable's dimensions take {len(dims)} bytes")
    if min(struct.unpack(f"{var.order}{len(dims) // 4}i", dims)) < 0:
        raise ValueError("a variable has a negative dimension")
    var.element("name", frozenset({MI_INT8, MI_UTF8}))
    var.element("real part", NUMERIC_TYPES)
    if word & COMPLEX_FLAG:
        var.element("imaginary part", NUMERIC_TYPES)
    if var.left:
        raise ValueError(f"a variable holds {var.left} bytes past its data")
