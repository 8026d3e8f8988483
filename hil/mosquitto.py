"""A private Mosquitto on a loopback port, with a generated config, that a harness can kill and restart.

For benches and chaos tests: it can hold a thousand connections (no connection cap, a raised
open-files limit), keep retained messages and persistent sessions across a restart when
`persistence` is on, and enforce a password file and an ACL file when given, or run the listeners,
logins, ACLs and limits of a `fedal fleet init` broker config (`fleet_conf`).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fedal import procs
from fedal.ports import free_port  # noqa: F401 (part of this module's API for callers)


def raise_open_files_limit(want: int = 8192) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `want` (children inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class Mosquitto:
    def __init__(self, workdir: Path, port: int | None = None, *, persistence: bool = False,
                 password_file: Path | None = None, acl_file: Path | None = None, max_queued_messages: int = 100_000,
                 max_connections: int = 4096, fleet_conf: Path | None = None):
        """fleet_conf: a generated fedal.conf (made with --bind 127.0.0.1 and --broker-dir pointing at its
        files, its device listener on `port`) instead of one loopback listener and password/ACL files."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(self.binary).exists():
            raise FileNotFoundError("mosquitto is not installed (Debian: apt-get install mosquitto)")
        self.log_file = self.workdir / "mosquitto.log"
        self.conf = self.workdir / "mosquitto.conf"
        lines = [] if fleet_conf is not None else [f"listener {self.port} 127.0.0.1", f"max_connections {max_connections}"]
        lines += [
            f"max_queued_messages {max_queued_messages}",
            f"persistence {'true' if persistence else 'false'}",
            "set_tcp_nodelay true",  # as fleet/generate.py's production snippet: no Nagle delay per message
            f"log_dest file {self.log_file}",
            "log_type error", "log_type warning", "log_type notice", "log_type information",
        ]
        if persistence:
            lines += [f"persistence_location {self.workdir}/", "autosave_interval 1"]
        if os.geteuid() == 0:
            lines.append("user root")  # as root it would drop to a user that cannot write the workdir
        if fleet_conf is not None:
            lines.append(Path(fleet_conf).read_text())
        elif password_file is not None:
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        else:
            lines.append("allow_anonymous true")
        if acl_file is not None and fleet_conf is None:
            lines.append(f"acl_file {acl_file}")
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        raise_open_files_limit(max(4096, 2 * 4096))
        self.proc = procs.spawn([self.binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL)  # dies with us
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mosquitto did not listen on port {self.port}: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, no last save of the persistence file, no Wills."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM: Mosquitto saves its persistence file and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 20) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
