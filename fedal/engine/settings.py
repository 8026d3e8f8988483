"""Deadlines, quorum and pause points: how a phase waits for its clients, in simulation and
deployment alike."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from fedal.strict_fields import NoCoercion


class PausePoint(NoCoercion):
    """A place where the run holds by itself, as if POST .../pause had come just before it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    round: int = Field(ge=1, description="the round (1-based, as the API counts)")
    phase: str | None = Field(None, pattern=r"^[a-z][a-z0-9_]*$",
                              description="a phase of that round (local_train, transfer, train, evaluate, ...); "
                              "none: its first phase")
    iteration: int | None = Field(None, ge=0, description="that phase's iteration (transfer: 0 to tau-1); none: its first")

    def matches(self, round_index: int, phase: str, iteration: int) -> bool:
        return (self.round == round_index + 1 and self.phase in (None, phase)
                and self.iteration in (None, iteration))

    def label(self) -> str:
        return f"round {self.round}" + (f" {self.phase}" if self.phase else "") + (
            f" iteration {self.iteration}" if self.iteration is not None else "")


class PhaseSettings(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    deadline_s: float = Field(60.0, gt=0, description="a phase closes at its deadline if the quorum answered")
    train_deadline_s: float = Field(300.0, gt=0, description="deadline of training phases (the strategy's `train` kind)")
    quorum: float = Field(0.5, gt=0, le=1, description="fraction of a phase's clients (those that did not decline "
                         "their task) needed to close it at the deadline")
    resend_s: float = Field(30.0, gt=0, description="re-send unanswered tasks to online clients this often")
    start_timeout_s: float = Field(120.0, ge=0,
                                   description="before the first round, wait this long for every client to be online")
    pause_at: list[PausePoint] = Field(default_factory=list, description="hold the run before these phases (each once; "
                                       "a restarted coordinator replaying that round holds again); resume over the API")
