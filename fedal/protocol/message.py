"""The unit every strategy half exchanges: small metadata plus named numpy arrays.

Simulation passes these objects directly; the MQTT runtime encodes them with
`fedal.protocol.envelope`, so a strategy never knows which transport carries it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

Scalar = str | int | float | bool | None
# what a result shares with the task it answers: not sent again, the receiver restores it
TASK_CONTEXT = ("phase", "round", "iteration")


@dataclass
class Message:
    meta: dict[str, Scalar] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return str(self.meta.get("phase", ""))

    def number(self, key: str, default: float | None = None) -> float:
        """meta[key] as a float (default when absent); a value that is no number is refused."""
        value = self.meta.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None = None) -> int:
        """meta[key] as an int (default when absent); a non-integer is refused."""
        value = self.meta.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value

    def tensor_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.tensors.values()))

    def with_meta(self, **extra: Any) -> Message:
        return Message({**self.meta, **extra}, dict(self.tensors))


def answering(result: Message, task: Message) -> Message:
    """`result` as the answer to `task`: the context it does not resend (TASK_CONTEXT) is the task's."""
    return Message({**{k: task.meta[k] for k in TASK_CONTEXT if k in task.meta}, **result.meta}, result.tensors)
