"""The client side of a run without I/O: what a device does with a task, whichever transport
brought it (the edge agent over MQTT, the in-process transport in simulation)."""

from fedal.session.session import (
    MAX_HELD,
    STORE_FAILED,
    ClientSession,
    NewTask,
    SessionStore,
    TaskRefused,
    declining,
    evaluation_reply,
    hold_until_joined,
    missed_step_decline,
)

__all__ = ["MAX_HELD", "STORE_FAILED", "ClientSession", "NewTask", "SessionStore", "TaskRefused", "declining",
           "evaluation_reply", "hold_until_joined", "missed_step_decline"]
