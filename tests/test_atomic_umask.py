"""A new file written atomically (results, plots, exports) gets the mode a plain write gives:
0666 less the umask, applied by the system (the umask is never read, so a machine without /proc
is no different, nor ever set, which races with threads); a file it replaces keeps its mode."""

from __future__ import annotations

import os
import stat

import pytest

from fedal import atomic


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_mode_of_a_plain_write(tmp_path, mask):
    old = os.umask(mask)
    try:
        atomic.write_bytes_atomic(tmp_path / "results.json", b"{}")
        with open(tmp_path / "plain.json", "w") as fh:
            fh.write("{}")
        atomic.write_bytes_atomic(tmp_path / "secret.pt", b"x", private=True)
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "results.json").stat().st_mode)
    assert mode == 0o666 & ~mask == stat.S_IMODE((tmp_path / "plain.json").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "secret.pt").stat().st_mode) == 0o600
    os.chmod(tmp_path / "results.json", 0o640)
    atomic.write_bytes_atomic(tmp_path / "results.json", b"{}")
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == 0o640  # the mode of the file it replaces
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "results.json", "secret.pt"]


def test_a_temporary_file_is_named_as_a_torn_write_is_recognised(tmp_path):
    fd, tmp = atomic.temporary_beside(tmp_path / "run.ckpt", private=True)
    os.close(fd)
    torn = atomic.TEMPORARY_NAME.match(os.path.basename(tmp))
    assert torn and torn["name"] == "run.ckpt" and stat.S_IMODE(os.stat(tmp).st_mode) == 0o600
