"""DP-SGD for a client's steps on its private data (Abadi et al. 2016, as Opacus runs it).

The one training loop (fedal/strategies/training.py) calls in here when a client trains
privately. Each step draws its batch by Poisson sampling (every private sample joins with probability
q = batch_size / n, the sampling the accountant assumes), computes every sample's gradient
(Opacus's GradSampleModule hooks, attached for these steps only), clips each to max_grad_norm C,
sums them, adds Gaussian noise of std sigma * C to the sum and divides by the expected batch size
q * n; then the client's own optimizer steps. The noise and the sampling come from the client's
own generator, checkpointed with it (on the device: its checkpoint never leaves it). A simulation
seeds it from the client's seed (reproducible; no one there to hide from); an agent draws it from
the operating system (`draw_secretly`), as anyone who knows a seed (the coordinator may: the run's
seed, the agent's default) could take the noise away again.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from fedal.privacy.accountant import PrivacyAccountant
from fedal.privacy.settings import PrivacyParams
from fedal.privacy.statistics import private_class_means, private_count

log = logging.getLogger("fedal.privacy")
T = TypeVar("T")


class PrivacyUnavailable(ValueError):
    """This installation cannot apply privacy settings (Opacus, the `privacy` extra, is missing):
    a device refuses such a run rather than train without the privacy it promises."""


def require_opacus() -> None:
    try:
        import opacus  # noqa: F401
    except ImportError as exc:
        raise PrivacyUnavailable(f"the run asks for differential privacy and this installation cannot apply it: "
                                 f"{exc} (install the `privacy` extra: pip install 'fedal-edge[privacy]')") from None


class PrivacyBudgetExhausted(Exception):
    """The steps asked for would take this client past its epsilon_budget: none was taken."""


def dp_compatible(model: torch.nn.Module, name: str = "model", announce: bool = True) -> torch.nn.Module:
    """`model`, or a variant Opacus can train per sample: BatchNorm mixes the samples of a batch,
    so it is replaced by GroupNorm (Opacus's ModuleValidator.fix), with a message."""
    from opacus.validators import ModuleValidator

    problems = ModuleValidator.validate(model, strict=False)
    if not problems:
        return model
    fixed = ModuleValidator.fix(model)
    left = ModuleValidator.validate(fixed, strict=False)
    if left:
        raise ValueError(f"{name} cannot be trained with differential privacy: {'; '.join(map(str, left))}")
    replaced = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)})
    log.log(logging.WARNING if announce else logging.DEBUG,
            "%s: %s mixes the samples of a batch, which per-sample clipping cannot bound; using its DP-compatible "
            "variant (BatchNorm -> GroupNorm)", name, ", ".join(replaced) or "a layer Opacus cannot train per sample")
    return fixed


class PrivateTraining:
    """One client's DP-SGD: its sampling, its noise, its accountant."""

    def __init__(self, params: PrivacyParams, n: int, batch_size: int, seed: int, steps_per_round: int = 1,
                 releases_per_round: int = 0, one_off_steps: int = 0):
        if n < 1:
            raise ValueError("differentially private training needs private samples")
        require_opacus()
        self.params = params
        self.n = n
        if params.delta * n >= 1:  # one sample of such a set may leak with probability delta: no guarantee
            log.warning("differential privacy: delta %g is not below 1 / n for %d private samples: the guarantee is "
                        "weak (lower privacy.delta below %g)", params.delta, n, 1 / n)
        self.sample_rate = min(1.0, batch_size / n)
        self.expected_batch = self.sample_rate * n
        self.generator = torch.Generator().manual_seed(int(seed) % 2**64)
        self.accountant = PrivacyAccountant(params.accountant)
        self._sigma = params.sigma_for(self.sample_rate, steps_per_round, releases_per_round, one_off_steps)
        self.refused_steps = 0  # steps not taken because of the budget
        self._gsm: Any = None  # Opacus's GradSampleModule while per_sample() is open

    def draw_secretly(self) -> None:
        """The noise and sampling from here on drawn from a seed of the operating system's
        randomness that never leaves this process (and its checkpoint): no one who knows the run's
        or the device's seed can reproduce them."""
        self.generator.manual_seed(secrets.randbits(64))

    @property
    def sigma(self) -> float:
        return self._sigma

    def epsilon(self) -> float:
        return self.accountant.epsilon(self.params.delta)

    def affordable(self, steps: int, releases: int = 0) -> bool:
        """Whether `steps` more steps and `releases` more private statistics keep this client
        within its epsilon_budget."""
        budget = self.params.epsilon_budget
        if budget is None or steps + releases == 0:
            return True
        trial = PrivacyAccountant(self.accountant.kind)
        trial.load_state_dict(self.accountant.state_dict())
        trial.step(self.sigma, self.sample_rate, steps)
        trial.step(self.sigma, 1.0, releases)
        return trial.epsilon(self.params.delta) <= budget

    def batches(self, steps: int) -> list[torch.Tensor]:
        """Poisson-sampled row indices for `steps` steps (a batch may be empty)."""
        return [torch.nonzero(torch.rand(self.n, generator=self.generator) < self.sample_rate).flatten()
                for _ in range(steps)]

    def check_budget(self, steps: int, releases: int = 0) -> None:
        """PrivacyBudgetExhausted, before anything changes, if `steps` more steps (and `releases`
        more private statistics) would exceed the budget."""
        if not self.affordable(steps, releases):
            self.refused_steps += steps
            raise PrivacyBudgetExhausted(f"{steps} more steps"
                                         f"{f' and {releases} statistics' if releases else ''} would exceed epsilon_budget "
                                         f"{self.params.epsilon_budget:g} (epsilon now {self.epsilon():.4g})")

    @contextlib.contextmanager
    def per_sample(self, model: torch.nn.Module) -> Iterator[None]:
        """Per-sample gradients of `model` inside (Opacus's hooks, removed on the way out: the
        model is left as it was). The training loop's backward then fills `grad_sample`."""
        from opacus import GradSampleModule

        gsm = self._gsm = GradSampleModule(model, loss_reduction="mean")  # the losses are batch means
        try:
            with warnings.catch_warnings():  # inputs need no gradient: the hook fires on outputs, as meant
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                yield
        finally:
            self._gsm = None
            gsm._close()

    @contextlib.contextmanager
    def public_term(self) -> Iterator[None]:
        """Inside: the forward and backward of a loss term that touches no private data (FedHKD's
        head term on the server's knowledge). Per-sample hooks are off, so its gradient joins the
        noised one as it is: public information, neither clipped nor noised."""
        gsm = self._gsm
        if gsm is not None:
            gsm.disable_hooks()
        try:
            yield
        finally:
            if gsm is not None:
                gsm.enable_hooks()

    def privatize(self, params: list[torch.nn.Parameter], batch: int) -> None:
        """After the backward of a batch of `batch` rows: each parameter's gradient becomes the
        clipped per-sample sum plus noise, over the expected batch size; the step is accounted."""
        if batch:
            # Opacus's hooks put each parameter's per-sample gradients on it (none: the loss does not use it)
            found = [getattr(p, "grad_sample", None) for p in params]
            per_sample = [g if g is not None else torch.zeros(batch, *p.shape) for g, p in zip(found, params)]
            summed = clipped_sum(per_sample, self.params.max_grad_norm)
        else:  # an empty Poisson batch: the step is noise alone
            summed = [torch.zeros_like(p) for p in params]
        std = self.sigma * self.params.max_grad_norm
        for p, s in zip(params, summed):
            noise = torch.normal(0.0, std, size=p.shape, generator=self.generator) if std > 0 else 0.0
            p.grad = (s + noise) / self.expected_batch
            setattr(p, "grad_sample", None)  # noqa: B010  (an attribute of Opacus's, not torch's)
        self.accountant.step(self.sigma, self.sample_rate)

    def spend(self, who: str, work: Callable[[], T]) -> tuple[dict[str, Any], T | None]:
        """`work()` (which checks the budget before its first step) and what a result reports in
        place of private losses: the privacy spent and whether the budget stopped it. Its value is
        None when it did (nothing was taken: the client goes on with what costs no privacy)."""
        try:
            out: T | None = work()
            exhausted = False
        except PrivacyBudgetExhausted as exc:
            log.info("%s trains no more on its private data: %s", who, exc)
            out, exhausted = None, True
        # the noise multiplier too: under target_epsilon each client calibrates its own
        return {"dp_exhausted": exhausted, "epsilon": self.epsilon(), "noise_multiplier": self.sigma}, out

    def release_class_means(self, values: torch.Tensor, labels: torch.Tensor, num_classes: int,
                            clip: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Per-class means and counts of private `values` through the Gaussian mechanism (same
        noise multiplier as the training steps, fedal/privacy/statistics.py), accounted as one step
        at sample rate 1."""
        out = private_class_means(values, labels, num_classes, clip, self.sigma, self.generator)
        self.accountant.step(self.sigma, 1.0)
        return out

    def release_count(self, count: int, most: int) -> int:
        """A count of private samples through the Gaussian mechanism, accounted as one step at
        sample rate 1."""
        out = private_count(count, self.sigma, self.generator, most)
        self.accountant.step(self.sigma, 1.0)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "accountant": self.accountant.state_dict(),
                "refused_steps": self.refused_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.accountant.load_state_dict(state["accountant"])
        self.refused_steps = int(state.get("refused_steps", 0))


def clipped_sum(grad_samples: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Sum over the batch of each sample's gradient scaled to L2 norm at most `max_norm`, the norm
    taken over all of the sample's parameters together (Opacus's flat clipping)."""
    batch = grad_samples[0].shape[0]
    norms = torch.stack([g.reshape(batch, -1).norm(dim=1) for g in grad_samples], dim=1).norm(dim=1)
    # a sample whose gradient is not finite adds nothing (inf * 0 is NaN: the sum, and so what
    # the step releases, would depend on that one sample being there)
    factor = torch.where(norms.isfinite(), (max_norm / (norms + 1e-6)).clamp(max=1.0), 0.0)
    grad_samples = [torch.where(factor.reshape(-1, *[1] * (g.dim() - 1)) > 0, g, 0.0) for g in grad_samples]
    return [torch.einsum("i,i...->...", factor, g) for g in grad_samples]
