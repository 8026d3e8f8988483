"""One client's privacy ledger: every DP-SGD step it took, composed by Opacus's accountant."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np


class PrivacyAccountant:
    """Opacus's RDP (or PRV) accountant over the (noise multiplier, sample rate, steps) history;
    checkpointed with the client (state_dict), so a restarted device keeps its spent budget."""

    def __init__(self, kind: str = "rdp"):
        from opacus.accountants import create_accountant

        self.kind = kind
        self._accountant = create_accountant(kind)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """`steps` steps of (noise multiplier, sample rate), merged into the last entry of the
        history when it has the same two, as Opacus's own step() does one step at a time."""
        if steps <= 0:
            return
        history = self._accountant.history
        if history and history[-1][:2] == (noise_multiplier, sample_rate):
            history[-1] = (noise_multiplier, sample_rate, history[-1][2] + steps)
        else:
            history.append((noise_multiplier, sample_rate, steps))

    def epsilon(self, delta: float) -> float:
        if not self._accountant.history:
            return 0.0
        if self.kind == "rdp":  # Opacus's RDPAccountant.get_epsilon, its per-step RDP remembered
            from opacus.accountants.analysis.rdp import get_privacy_spent
            from opacus.accountants.rdp import RDPAccountant

            rdp = sum([_rdp_of_one_step(q, sigma) * steps for sigma, q, steps in self._accountant.history])
            eps = float(get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0])
        else:
            eps = float(self._accountant.get_epsilon(delta=delta))
        # the RDP conversion goes below 0 for a large delta (about 0.4 and up): the guarantee then
        # holds at epsilon 0 (a negative one made the coordinator reject every result)
        return max(0.0, eps)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """The epsilon this client would have after `steps` more steps (nothing is spent)."""
        trial = PrivacyAccountant(self.kind)
        trial._accountant.history = copy.deepcopy(self._accountant.history)
        trial.step(noise_multiplier, sample_rate, steps)
        return trial.epsilon(delta)

    @property
    def steps(self) -> int:
        return int(sum(n for _, _, n in self._accountant.history))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "history": [list(h) for h in self._accountant.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"a {state['kind']} accountant's state does not load into a {self.kind} accountant")
        self._accountant.history = [tuple(h) for h in state["history"]]


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """The RDP of one sampled Gaussian step at Opacus's default orders. Opacus computes it afresh
    for every epsilon asked (0.1 s on a desktop core, a series per order); a ledger's entries and a
    noise calibration's trials ask the same few again and again. T steps cost T times one step,
    which is how Opacus scales it too, so the epsilons are Opacus's to the bit."""
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.rdp import RDPAccountant

    rdp = np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                 orders=RDPAccountant.DEFAULT_ALPHAS))
    rdp.setflags(write=False)
    return rdp
