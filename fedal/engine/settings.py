"""Deadlines and quorum: how long a phase waits for its clients, in simulation and deployment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PhaseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deadline_s: float = Field(60.0, gt=0, description="a phase closes at its deadline if the quorum answered")
    train_deadline_s: float = Field(300.0, gt=0, description="deadline of training phases (the strategy's `train` kind)")
    quorum: float = Field(0.5, gt=0, le=1, description="fraction of a phase's clients needed to close it at the deadline")
    resend_s: float = Field(30.0, gt=0, description="re-send unanswered tasks to online clients this often")
    start_timeout_s: float = Field(120.0, ge=0, description="before the first round, wait this long for every client to be online")
