"""A run's privacy settings (`[privacy]` in the run config, `privacy` in the strategy params the
manifest carries to every device)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from fedal.strict_fields import NoCoercion


class UnreachableTarget(ValueError):
    """A target_epsilon no noise reaches for a client's steps: a setting of the run to change."""


class PrivacyParams(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite sigma hung the accountant

    noise_multiplier: float | None = Field(
        None, ge=0, le=1e6, description="sigma: the Gaussian noise's std is sigma * max_grad_norm (unset: calibrated from "
        "target_epsilon)")
    max_grad_norm: float = Field(1.0, gt=0, description="C: every sample's gradient is clipped to this L2 norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="the run-wide delta every client's epsilon is stated at")
    epsilon_budget: float | None = Field(
        None, gt=0, description="a client whose epsilon would exceed this stops training on its private data")
    target_epsilon: float | None = Field(
        None, gt=0, description="instead of noise_multiplier: each client calibrates its own noise so that its "
        "epsilon reaches this after the run's planned rounds (its sampling rate and steps depend on its data size)")
    planned_rounds: int | None = Field(
        None, ge=1, description="rounds the run plans, for target_epsilon (the run sets it)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant: RDP, or the tighter PRV")
    statistic_clip: float = Field(
        1.0, gt=0, description="private statistics (FedProto's prototypes): each sample's feature vector is clipped "
        "to this L2 norm before the per-class sums are noised (FD's softmax rows have norm <= 1 and use 1)")

    @model_validator(mode="after")
    def _noise_or_target(self) -> PrivacyParams:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("privacy needs noise_multiplier or target_epsilon")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("privacy takes noise_multiplier or target_epsilon, not both (the noise is calibrated "
                             "from the target)")
        return self

    def sigma_for(self, sample_rate: float, steps_per_round: int, releases_per_round: int = 0,
                  one_off_steps: int = 0) -> float:
        """The noise multiplier of a client sampling at `sample_rate`, taking `steps_per_round`
        DP-SGD steps and `releases_per_round` private statistics a round (and `one_off_steps`
        once, e.g. a pretraining): the one set, or the smallest that keeps its epsilon after the
        planned rounds at or below target_epsilon (bisection to within 0.01 of it)."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        if self.planned_rounds is None or self.target_epsilon is None:
            raise ValueError("target_epsilon needs planned_rounds (the run's rounds)")
        from fedal.privacy.accountant import PrivacyAccountant

        rounds, target = self.planned_rounds, self.target_epsilon

        def epsilon(sigma: float) -> float:
            trial = PrivacyAccountant(self.accountant)
            trial.step(sigma, sample_rate, steps_per_round * rounds + one_off_steps)  # the order does not matter
            trial.step(sigma, 1.0, releases_per_round * rounds)
            return trial.epsilon(self.delta)

        low, high = 0.0, 1.0
        while epsilon(high) > target:
            low, high = high, 2 * high
            if high > 1e4:
                raise UnreachableTarget(f"no noise multiplier reaches target_epsilon {target:g} in "
                                        f"{rounds} rounds: ask for a larger target_epsilon")
        while epsilon(high) < target - 0.01 and high - low > 1e-4:
            mid = (low + high) / 2
            low, high = (mid, high) if epsilon(mid) > target else (low, mid)
        return high
