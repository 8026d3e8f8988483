"""The umask a new file's mode follows (results, exports): read from /proc where there is one,
found from a scratch file's mode where there is none (macOS), never set (a race with threads)."""

from __future__ import annotations

import os
import stat

import pytest

from fedal import atomic


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_the_umask_is_found_without_proc_too(monkeypatch, tmp_path, mask):
    old = os.umask(mask)
    try:
        assert atomic.current_umask() == mask
        real_read = atomic.Path.read_text

        def no_proc(self, *args, **kwargs):
            if str(self).startswith("/proc/"):
                raise FileNotFoundError(str(self))
            return real_read(self, *args, **kwargs)

        monkeypatch.setattr(atomic.Path, "read_text", no_proc)
        monkeypatch.setattr(atomic.tempfile, "tempdir", str(tmp_path))
        assert atomic.current_umask() == mask
        assert list(tmp_path.iterdir()) == []  # the scratch file is gone
        atomic.write_bytes_atomic(tmp_path / "results.json", b"{}")
        assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == 0o666 & ~mask
    finally:
        os.umask(old)
