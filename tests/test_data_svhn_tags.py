"""A damaged SVHN .mat file is a clear error, never a crashed process: scipy's v5 reader looks a
tag's data type up without a bounds check (SIGSEGV on one flipped bit), so every tag is checked
first (fedal/data/mat_v5.py). The loads run in a child process: a crash there fails the test
instead of taking the test run down."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

scipy_io = pytest.importorskip("scipy.io")

BAD_TYPES = [0, 8, 10, 11, 19, 20, 25, 200, 0x4002, 100000]


def _svhn(path: Path, compressed: bool, n: int = 3) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    scipy_io.savemat(path, {"X": x, "y": np.arange(1, n + 1, dtype=np.uint8).reshape(n, 1)},
                     do_compression=compressed)


def _variables(raw: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, type, body) of each top-level element."""
    out, pos = [], 128
    while pos < len(raw):
        kind, n = struct.unpack("<II", raw[pos:pos + 8])
        out.append((pos, kind, raw[pos + 8:pos + 8 + n]))
        pos += 8 + n
    return out


def _data_tag(matrix: bytes) -> int:
    """Offset, in a miMATRIX element (tag included), of its fourth sub-element's tag: the data."""
    pos = 8
    for _ in range(3):  # flags, dimensions, name
        first, n = struct.unpack("<II", matrix[pos:pos + 8])
        pos += 8 if first >> 16 else 8 + n + (-n % 8)
    return pos


def _with_type(raw: bytes, variable: int, kind: int) -> bytes:
    """The file with the data tag of its `variable`-th variable set to `kind`."""
    pos, outer, body = _variables(raw)[variable]
    if outer == 15:  # compressed: change it inflated, deflate it again
        inner = bytearray(zlib.decompress(body))
        struct.pack_into("<I", inner, _data_tag(bytes(inner)), kind)
        packed = zlib.compress(bytes(inner))
        return raw[:pos] + struct.pack("<II", 15, len(packed)) + packed + raw[pos + 8 + len(body):]
    out = bytearray(raw)
    struct.pack_into("<I", out, pos + _data_tag(raw[pos:pos + 8 + len(body)]), kind)
    return bytes(out)


LOAD_ALL = """
import json, sys
from fedal.data.files import _read_svhn
from pathlib import Path
out = {}
for name in sys.argv[1:]:
    try:
        _read_svhn(Path(name), "svhn")
        out[name] = "loaded"
    except ValueError as exc:
        out[name] = "ValueError: " + str(exc)
print(json.dumps(out))
"""


def _load_each(paths: list[Path]) -> dict[str, str]:
    r = subprocess.run([sys.executable, "-c", LOAD_ALL, *map(str, paths)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, f"the loading process ended with {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(r.stdout)


@pytest.mark.parametrize("compressed", [False, True])
def test_an_unknown_data_type_in_any_tag_is_a_value_error_naming_the_file(tmp_path, compressed):
    _svhn(tmp_path / "base.mat", compressed)
    raw = (tmp_path / "base.mat").read_bytes()
    paths = []
    for variable in (0, 1):  # X's pixels, y's labels
        for kind in BAD_TYPES:
            path = tmp_path / f"v{variable}-t{kind}.mat"
            path.write_bytes(_with_type(raw, variable, kind))
            paths.append(path)
    outcomes = _load_each([tmp_path / "base.mat", *paths])
    assert outcomes.pop(str(tmp_path / "base.mat")) == "loaded"
    for path, outcome in outcomes.items():
        assert outcome.startswith("ValueError: " + path), (path, outcome)
        assert "not a readable SVHN .mat file" in outcome


@pytest.mark.parametrize("compressed", [False, True])
def test_random_damage_to_the_tags_never_crashes_the_reader(tmp_path, compressed):
    _svhn(tmp_path / "base.mat", compressed)
    raw = (tmp_path / "base.mat").read_bytes()
    rng = random.Random(7)
    paths = []
    for i in range(120):  # bytes of the header and the element tags (pixels changed load as other pixels)
        out = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(min(len(out), 400))] = rng.randrange(256)
        path = tmp_path / f"damaged-{i}.mat"
        path.write_bytes(bytes(out))
        paths.append(path)
    outcomes = _load_each(paths)
    assert len(outcomes) == len(paths)
    assert all(o == "loaded" or o.startswith("ValueError: ") for o in outcomes.values())


def test_scipys_own_files_of_numeric_arrays_pass_the_check():
    """The check is no stricter than scipy where a file is fine: the v5 files scipy ships for its
    tests that hold numeric arrays alone (big-endian ones, MATLAB 6 and 7, compressed or not,
    long names, doubles stored as small integers, dimensions as uint32, names as UTF-8) pass."""
    import os

    from fedal.data.mat_v5 import check_numeric_mat_v5

    data = Path(os.path.dirname(scipy_io.matlab.__file__)) / "tests" / "data"
    if not data.is_dir():
        pytest.skip("this scipy has no test data")
    checked = []
    for path in sorted(data.glob("*.mat")):
        try:
            if scipy_io.matlab.matfile_version(path)[0] != 1:
                continue
            loaded = scipy_io.loadmat(path)
        except Exception:  # noqa: BLE001 - files scipy itself refuses are not this test's
            continue
        if all(isinstance(v, np.ndarray) and v.dtype.kind in "biufc" for k, v in loaded.items() if not k.startswith("__")):
            check_numeric_mat_v5(path)
            checked.append(path.name)
    assert len(checked) >= 10, checked
    assert {"miuint32_for_miint32.mat", "miutf8_array_name.mat"} <= set(checked)
