"""`fedal simulate --plot`: a run with one evaluation (one round, or eval_every past its rounds)
shows its point, on whole rounds; before, a line of one point drew nothing."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from fedal.sim.plot import plot_accuracy


def results(evaluated: list[int], tau: int = 5) -> dict:
    return {"config": {"strategy_params": {"tau": tau}},
            "rounds": [{"round": r, **({"mean_acc": 0.5 + r / 100} if r in evaluated else {})} for r in range(4)]}


@pytest.mark.parametrize("evaluated, marked", [([3], True), ([0, 1], False), ([0, 1, 2, 3], False)])
def test_a_run_with_one_evaluation_shows_its_point(tmp_path, monkeypatch, evaluated, marked):
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    assert plot_accuracy({"fedal": results(evaluated)}, tmp_path / "acc.png").is_file()
    (ax,) = figures[0].axes
    (line,) = ax.lines
    assert list(line.get_xdata()) == evaluated
    assert (line.get_marker() not in (None, "None", "", " ")) == marked
    left, right = ax.get_xlim()
    assert left < min(evaluated) and right > max(evaluated)  # no point on the axis' edge
    ticks = [t for t in ax.get_xticks() if left <= t <= right]
    assert ticks and all(float(t).is_integer() for t in ticks)  # whole rounds, one point or many
