"""Every firmware script answers an argument it does not take with its usage and exit status 2
(a usage error, which fedal-firstboot does not retry), before it looks at anything else."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "firmware_scripts"


@pytest.mark.parametrize("script", ["flash.sh", "install-agent.sh", "arm64-smoke.sh", "pi-image.sh", "boot-test.sh"])
def test_an_unknown_argument_is_a_usage_error(script, tmp_path):
    r = subprocess.run(["bash", str(SCRIPTS / script), "--no-such-option"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "unknown argument: --no-such-option" in r.stderr and "sage" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
