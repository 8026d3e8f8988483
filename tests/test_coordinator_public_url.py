"""The public set's URL a run announces reaches it: an API bound to an IPv6 address puts it in
brackets (without them its colons read as a port, and no agent could fetch the set)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from coordinator.config import load_coordinator_config
from coordinator.run import Run
from edge_agent.public_set import load_public_set
from tests.local_api import served


def test_an_agent_fetches_the_public_set_from_an_api_on_ipv6_loopback(tmp_path):
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as probe:
            port = probe.getsockname()[1]
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback on this machine: {exc}")
    public = np.arange(60, dtype=np.float32).reshape(6, 10)
    np.savez(tmp_path / "public.npz", x=public)
    run = Run(load_coordinator_config(None, run_id="v6", client_ids=["a", "b"], public_file=tmp_path / "public.npz",
                                      state_dir=tmp_path / "state", api={"host": "::1", "port": port}))
    url = run.manifest().public_url
    assert url == f"http://[::1]:{port}/api/v1/runs/v6/public"
    try:
        with served(run, host="::1", port=port):
            fetched = load_public_set(run.public_hash, None, url, tmp_path / "agent" / "public.bin", timeout_s=10)
            np.testing.assert_array_equal(fetched.reshape(public.shape), public)
    finally:
        run.store.close()
