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
        None, gt=0, description="calibrate noise_multiplier so that the run's planned steps reach this epsilon")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant: RDP, or the tighter PRV")

    @model_validator(mode="after")
    def _noise_or_target(self) -> PrivacyParams:
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("privacy needs noise_multiplier or target_epsilon")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("privacy takes noise_multiplier or target_epsilon, not both (the noise is calibrated "
                             "from the target)")
        return self

    @property
    def sigma(self) -> float:
        if self.noise_multiplier is None:
            raise ValueError("noise_multiplier is not calibrated yet (target_epsilon is set)")
        return self.noise_multiplier
