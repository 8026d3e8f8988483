"""The agent's data files: the public set (provisioned, cached or fetched) and its private
.npz files. A torn or foreign cache is fetched again; anything unusable is one error naming
the file, never a set with NaN rows or labels silently truncated."""

from __future__ import annotations

import http.server
import io
import json
import threading

import numpy as np
import pytest

from edge_agent.agent import load_npz_dataset
from edge_agent.public_set import PublicSetError, load_public_set
from fedal.data import content_hash

X = np.arange(24, dtype=np.float32).reshape(6, 4)


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class _Served:
    """A loopback HTTP server answering every GET with `payload`; counts the fetches in `hits`."""

    def __init__(self, payload: bytes):
        hits: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                """No access log on the test's stderr: the fetches are counted in `hits`."""

        self.hits = hits
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/public.npz"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served():
    payload = npz_bytes(x=X)
    server = _Served(payload)
    yield server.url, payload, server.hits
    server.close()


def zip_refused(data: bytes, field: int, value: int) -> bytes:
    """`data` with one byte of its zip central directory changed: at +6 the version needed to
    extract (90: "9.0", zipfile's NotImplementedError), at +8 the flags (1: encrypted, its
    RuntimeError); errors other than ValueError escaped and stopped the agent."""
    damaged = bytearray(data)
    damaged[data.index(b"PK\x01\x02") + field] = value
    return bytes(damaged)


@pytest.mark.parametrize("torn", [b"", npz_bytes(x=X)[:50], b"not a zip at all", zip_refused(npz_bytes(x=X), 6, 90),
                                  zip_refused(npz_bytes(x=X), 8, 1)])
def test_a_torn_cache_is_fetched_again_and_replaced(tmp_path, served, torn):
    url, payload, hits = served
    cache = tmp_path / "public.npz"
    cache.write_bytes(torn)  # e.g. a power cut while the cache was written
    (tmp_path / ".public.npz.k2j3h4.tmp").write_bytes(b"half")  # and what a cut-short atomic write leaves
    x = load_public_set(content_hash(X), None, url, cache)
    assert np.array_equal(x, X) and len(hits) == 1
    assert cache.read_bytes() == payload
    assert np.array_equal(load_public_set(content_hash(X), None, url, cache), X) and len(hits) == 1  # cached now
    assert not [p.name for p in tmp_path.iterdir() if p.name != "public.npz"]  # no temporary file left


def test_a_cache_of_another_run_is_replaced(tmp_path, served):
    url, payload, hits = served
    cache = tmp_path / "public.npz"
    cache.write_bytes(npz_bytes(x=X + 1))
    assert np.array_equal(load_public_set(content_hash(X), None, url, cache), X) and len(hits) == 1
    assert cache.read_bytes() == payload


@pytest.mark.parametrize(("arrays", "problem"), [
    ({"x": np.array([[np.nan, 1.0]], np.float32)}, "NaN or infinite"),
    ({"x": np.zeros(0, np.float32)}, "at least one row"),
    ({"x": np.zeros((0, 4), np.float32)}, "at least one row"),
    ({"y": X}, "holds no array x"),
    ({"x": np.array(["a", "b"])}, "cannot be read as float32"),
])
def test_an_unusable_provisioned_public_set_is_one_error_naming_it(tmp_path, arrays, problem):
    file = tmp_path / "public.npz"
    file.write_bytes(npz_bytes(**arrays))
    with pytest.raises(PublicSetError, match=problem) as err:
        load_public_set(None, file, None, tmp_path / "cache.npz")
    assert str(file) in str(err.value) and "\n" not in str(err.value)


def test_a_torn_provisioned_public_set_is_one_error_naming_it(tmp_path, served):
    url, _, hits = served
    file = tmp_path / "public.npz"
    file.write_bytes(npz_bytes(x=X)[:60])
    with pytest.raises(PublicSetError, match="is not a readable .npz file") as err:
        load_public_set(content_hash(X), file, url, tmp_path / "cache.npz")  # the operator's file: not replaced
    assert str(file) in str(err.value) and not hits


def test_a_fetched_public_set_with_nan_rows_is_refused(tmp_path):
    bad = np.array([[np.nan, 1.0]], np.float32)
    server = _Served(npz_bytes(x=bad))
    try:
        with pytest.raises(PublicSetError, match="NaN or infinite"):
            load_public_set(content_hash(X), None, server.url, tmp_path / "cache.npz")
    finally:
        server.close()
    assert not (tmp_path / "cache.npz").exists()


def test_a_public_url_that_is_not_http_or_has_no_hash_is_never_fetched(tmp_path):
    """file:///var/lib/fedal-agent/train.npz made the device's private rows its 'public' set."""
    from fedal.protocol import ManifestError, RunManifest

    private = tmp_path / "train.npz"
    private.write_bytes(npz_bytes(x=X))
    with pytest.raises(PublicSetError, match="is not an http:// or https:// URL"):
        load_public_set(content_hash(X), None, private.as_uri(), tmp_path / "cache.npz")
    server = _Served(npz_bytes(x=X))
    try:
        with pytest.raises(PublicSetError, match="without a public_hash"):
            load_public_set(None, None, server.url, tmp_path / "cache.npz")
        assert server.hits == []
    finally:
        server.close()
    base = {"run_id": "r", "strategy": "fedmd", "strategy_params": {}, "num_classes": 10, "clients": ["a"], "rounds": 1}
    for bad, why in (({"public_url": private.as_uri(), "public_hash": "ab"}, "http:// or https://"),
                     ({"public_url": "http://h/p"}, "public_url needs public_hash")):
        with pytest.raises(ManifestError, match=why):
            RunManifest.from_json(json.dumps({**base, **bad}).encode())


def test_a_public_set_declaring_more_than_the_run_can_hold_is_refused_before_it_is_inflated(tmp_path):
    """A compressed .npz of a few kB may declare a gigabyte: a Pi was OOM-killed inflating it."""
    import tracemalloc

    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((2000, 2000), np.float32))  # 16 MB inflated, 16 kB on the wire
    bomb = buf.getvalue()
    assert len(bomb) < 100_000
    server = _Served(bomb)
    try:
        tracemalloc.start()
        with pytest.raises(PublicSetError, match=r"x declares shape \[2000, 2000\]"):
            load_public_set(content_hash(X), None, server.url, tmp_path / "cache.npz", max_elements=X.size)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4_000_000  # never inflated
        long = _Served(b"\x00" * (2 << 20))  # longer on the wire than such a set can be: not read to its end
        ok = _Served(npz_bytes(x=X))
        try:
            with pytest.raises(PublicSetError, match="is longer than the run's public set can be"):
                load_public_set(content_hash(X), None, long.url, tmp_path / "cache.npz", max_elements=X.size)
            assert np.array_equal(load_public_set(content_hash(X), None, ok.url, tmp_path / "c2.npz",
                                                  max_elements=X.size), X)  # a set of the declared size loads
        finally:
            long.close()
            ok.close()
    finally:
        server.close()
    assert not (tmp_path / "cache.npz").exists()



def test_private_files_load_with_whole_labels(tmp_path):
    path = tmp_path / "train.npz"
    np.savez(path, x=X, y=np.array([0, 1, 2, 3, 4, 5], np.uint8))
    data = load_npz_dataset(path, 10, "train")
    assert data.y.tolist() == [0, 1, 2, 3, 4, 5] and data.x.dtype == np.float32
    np.savez(path, x=X, y=np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]))  # whole numbers written as floats
    assert load_npz_dataset(path, 10, "train").y.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(("arrays", "problem"), [
    ({"x": X, "y": np.array([0.5, 1.9, 2.7, 3.2, 4.99, 5.0])}, "labels y must be integers, got float64 with fractional"),
    ({"x": X, "y": np.array([True, False] * 3)}, "labels y must be integers, got bool"),
    ({"x": np.where(X > 20, np.nan, X), "y": np.arange(6)}, "NaN or infinite"),
    ({"x": X}, "not arrays x and y"),
    ({"x": X, "y": np.arange(5)}, "6 rows but y has 5 labels"),
    ({"x": X, "y": np.arange(6) + 7}, r"labels must lie in \[0, 10\)"),
    # labels int64 would wrap to negatives: refused as what they are, not as "range [-9223372036854775808, 0]"
    ({"x": X, "y": np.array([0.0, 1, 2, 3, 4, np.inf])}, "labels y hold NaN or infinite"),
    ({"x": X, "y": np.array([0.0, 1, 2, 3, 4, 1e30])}, "class indices below 2147483648"),
    ({"x": X, "y": np.array([0, 1, 2, 3, 4, 2**63], np.uint64)}, "class indices below 2147483648"),
])
def test_unusable_private_files_are_one_error_naming_the_file(tmp_path, arrays, problem):
    path = tmp_path / "train.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=problem) as err:
        load_npz_dataset(path, 10, "train")
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_torn_private_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "train.npz"
    path.write_bytes(npz_bytes(x=X, y=np.arange(6))[:80])
    with pytest.raises(ValueError, match="is not an .npz of rows x and labels y") as err:
        load_npz_dataset(path, 10, "train")
    assert str(path) in str(err.value)


@pytest.mark.parametrize("small_x_npy_too", [False, True])
def test_an_entry_named_plain_x_is_checked_as_numpy_reads_it(tmp_path, small_x_npy_too):
    """numpy reads an entry `x` before `x.npy`: a bomb under that name passed the header check."""
    import zipfile

    from fedal.data.public import public_rows_from_npz

    big = io.BytesIO()
    np.lib.format.write_array(big, np.zeros((2000, 2000), np.float32))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        if small_x_npy_too:
            small = io.BytesIO()
            np.lib.format.write_array(small, X)
            z.writestr("x.npy", small.getvalue())
        z.writestr("x", big.getvalue())
    with pytest.raises(ValueError, match=r"x declares shape \[2000, 2000\]"):
        public_rows_from_npz(buf.getvalue(), "served", max_elements=X.size)


@pytest.mark.parametrize("compress", [False, True])
def test_what_the_coordinator_refuses_to_serve_is_what_an_agent_would_refuse(tmp_path, compress):
    """fedal.data.check_servable (the coordinator's start) against the agent's own reading of the
    same file for a run of its rows: labels beside a few rows push it over what an agent reads."""
    from fedal.data import check_servable

    x = np.ones((10, 4))
    save = np.savez_compressed if compress else np.savez
    buf = io.BytesIO()
    save(buf, x=x, y=np.zeros(200_000, np.int64))
    with pytest.raises(ValueError, match="every agent would refuse it"):
        check_servable(buf.getvalue(), x.astype(np.float32), "public_file p")
    ok = io.BytesIO()
    save(ok, x=x)
    check_servable(ok.getvalue(), x.astype(np.float32), "public_file p")  # x alone: served, and loaded
    bad, good = _Served(buf.getvalue()), _Served(ok.getvalue())
    try:
        with pytest.raises(PublicSetError):
            load_public_set(content_hash(x.astype(np.float32)), None, bad.url, tmp_path / "c1.npz", max_elements=x.size)
        got = load_public_set(content_hash(x.astype(np.float32)), None, good.url, tmp_path / "c2.npz",
                              max_elements=x.size)
    finally:
        bad.close()
        good.close()
    np.testing.assert_array_equal(got, x)


def declared_npz(descr: str, shape: tuple[int, ...]) -> bytes:
    """An .npz whose x.npy header declares `descr` and `shape`, with no data behind it."""
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("x.npy", header.getvalue())
        z.writestr("y.npy", npz_member(np.zeros(150, np.int64)))
    return out.getvalue()


def npz_member(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_a_string_dtype_is_no_public_set_nor_data_file(tmp_path):
    """A 236-byte file declaring 150 strings of 2 GB each passed the element count and made numpy
    allocate 279 GiB: a MemoryError escaped instead of the public set's error."""
    from fedal.data.public import public_rows_from_npz

    with pytest.raises(ValueError, match="not numbers"):
        public_rows_from_npz(declared_npz("|S2000000000", (150,)), "f", 1000)
    path = tmp_path / "data.npz"  # a private data file declaring as much is the loader's one error too
    path.write_bytes(declared_npz("|S2000000000", (150,)))
    with pytest.raises(ValueError, match=f"{path} is not an .npz of rows x and labels y"):
        load_npz_dataset(path, 10, "train")


def test_a_manifest_past_what_a_run_can_be_is_refused_in_one_line():
    """num_classes = 2,000,000 was joined: a model of gigabytes built and checkpointed on a Pi. And
    a refused manifest was logged as pydantic's sixteen lines."""
    from fedal.protocol import ManifestError, RunManifest

    base = {"run_id": "r", "strategy": "fedmd", "strategy_params": {}, "num_classes": 10, "clients": ["a"], "rounds": 1}
    for bad, why in (({"num_classes": 2_000_000}, "num_classes: Input should be less than or equal to 10000"),
                     ({"rounds": 10**18}, "rounds: Input should be less than or equal to 1000000000")):
        with pytest.raises(ManifestError, match=why) as info:
            RunManifest.from_json(json.dumps({**base, **bad}).encode())
        assert "\n" not in str(info.value)
    with pytest.raises(ManifestError) as info:
        RunManifest.from_json(b'{"run_id": "r1"}')
    assert "\n" not in str(info.value) and "strategy: Field required" in str(info.value)


@pytest.mark.parametrize("content, needle", [
    (lambda: npz_bytes(x=np.array([[np.nan, 1.0]], np.float32), y=np.array([0])), "x holds NaN or infinite values"),
    (lambda: npz_bytes(x=np.zeros((6, 4), np.float32), y=np.zeros(5, np.int64)), "x has 6 rows but y has 5 labels"),
    (lambda: npz_bytes(x=np.zeros((2, 4), np.float32)), "not arrays x and y"),
    (lambda: b"not a zip at all", "not a zip archive (torn, or another kind of file)"),  # not numpy's pickle words
])
def test_a_data_file_that_can_never_be_trained_on_is_a_usage_error_at_start(tmp_path, content, needle):
    """It was checked for existence only: the agent then retried joining the run for ever, with
    backoff, while the service looked healthy."""
    import subprocess
    import sys

    import tomli_w

    data = tmp_path / "train.npz"
    data.write_bytes(content())
    config = tmp_path / "agent.toml"
    config.write_text(tomli_w.dumps({"run_id": "r", "client_id": "c", "model": "mlp", "data_file": str(data),
                                     "workspace": str(tmp_path / "ws"), "broker": {"url": "mqtt://127.0.0.1:1"}}))
    r = subprocess.run([sys.executable, "-m", "edge_agent", "--config", str(config)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and f"Error: data_file: {data}" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
