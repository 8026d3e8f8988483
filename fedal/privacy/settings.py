"""A run's privacy settings (`[privacy]` in the run config, `privacy` in the strategy params the
manifest carries to every device)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PrivacyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    noise_multiplier: float | None = Field(
        None, ge=0, description="sigma: the Gaussian noise's std is sigma * max_grad_norm (unset: calibrated from "
        "target_epsilon)")
    max_grad_norm: float = Field(1.0, gt=0, description="C: every sample's gradient is clipped to this L2 norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="the run-wide delta every client's epsilon is stated at")
    epsilon_budget: float | None = Field(
        None, gt=0, description="a client whose epsilon would exceed this stops training on its private data")
    target_epsilon: float | None = Field(
        None, gt=0, description="instead of noise_multiplier: each client calibrates its own noise so that its "
        "epsilon reaches this after the run's planned steps (its sampling rate depends on its data size)")
    planned_steps: int | None = Field(
        None, ge=1, description="private steps a client takes over the whole run, for target_epsilon (the run sets "
        "it: rounds x local steps per round)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant: RDP, or the tighter PRV")

    @model_validator(mode="after")
    def _noise_or_target(self) -> PrivacyParams:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("privacy needs noise_multiplier or target_epsilon")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("privacy takes noise_multiplier or target_epsilon, not both (the noise is calibrated "
                             "from the target)")
        return self

    def sigma_for(self, sample_rate: float) -> float:
        """The noise multiplier of a client sampling at `sample_rate`: the one set, or the one its
        planned steps need to end at target_epsilon (Opacus's calibration, within 0.01)."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        if self.planned_steps is None or self.target_epsilon is None:
            raise ValueError("target_epsilon needs planned_steps (the run's rounds x local steps per round)")
        import warnings

        from opacus.accountants.utils import get_noise_multiplier

        with warnings.catch_warnings():  # a bound from the largest RDP order: still a valid (looser) bound
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(get_noise_multiplier(target_epsilon=self.target_epsilon, target_delta=self.delta,
                                              sample_rate=sample_rate, steps=self.planned_steps,
                                              accountant=self.accountant))
