"""A round's `wall_s` is the round's own time: a pause held before one of its phases (the API's
pause, or `phases.pause_at`) is left out of it, as it is of the phases' times."""

from __future__ import annotations

import threading
import time

from tests.helpers import in_process, toy_federation


def test_a_pause_is_not_counted_in_the_rounds_wall_time(one_torch_thread):
    server, clients, _ = toy_federation("fedmd", n_clients=2, tau=1)
    engine = in_process(server, clients)
    engine.run_round(0)  # warm
    engine.pause()  # held before round 2's first phase until resumed from another thread

    def resume_once_held_for_a_while() -> None:
        while engine.held_before is None:  # the hold starts when the round reaches its first phase
            time.sleep(0.01)
        time.sleep(1.5)
        engine.resume()

    resumer = threading.Thread(target=resume_once_held_for_a_while)
    resumer.start()
    started = time.monotonic()
    record = engine.run_round(1)
    took = time.monotonic() - started
    resumer.join()
    assert took >= 1.5 and engine.held_s >= 1.5  # it did hold
    assert record["wall_s"] <= took - engine.held_s + 0.01 and record["wall_s"] < 1.0
