"""Run persistence on disk: progress as JSON, the strategy's server state as a torch file.

Both are replaced atomically after every completed round (server state first), so a
coordinator killed at any moment restarts from the last completed round.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedal.atomic import torch_save_atomic, write_bytes_atomic


class RunStore:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.progress_path = self.dir / "progress.json"
        self.server_path = self.dir / "server_state.pt"

    def load_progress(self) -> dict[str, Any] | None:
        if not self.progress_path.exists():
            return None
        return json.loads(self.progress_path.read_text())

    def load_server_state(self) -> dict[str, Any]:
        if not self.server_path.exists():
            return {}
        return torch.load(self.server_path, weights_only=True)

    def save(self, progress: dict[str, Any], server_state: dict[str, Any] | None = None) -> None:
        if server_state is not None:
            torch_save_atomic(server_state, self.server_path)
        write_bytes_atomic(self.progress_path, json.dumps(progress, indent=1).encode())
