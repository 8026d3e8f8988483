"""Cached, parallel `fedal simulate` runs for the accuracy benchmarks.

Each run is one process (runs are single-threaded, so workers = cores) and its result is cached
as JSON under the benchmark's cache directory: a rerun after a change to the report only reads
them, and an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Hashable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm


def simulate_cached(config: dict, path: str) -> str:
    """`fedal simulate` of `config` into `path` unless a run of the same resolved config is there
    already (a default changed since, e.g. stacked clients, makes it run again); returns the path.
    The toolkit's code is not part of the key: after a change to what a run computes, remove the
    cache folder."""
    target = Path(path)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (this process's first run)
    from fedal.sim import RunConfig, simulate

    run = RunConfig(**config)
    # as the results record it (simulate makes the path that ran explicit)
    resolved = run.model_copy(update={"vectorize": run.vectorized}).resolved().model_dump(mode="json")
    if not target.exists() or json.loads(target.read_text()).get("config") != resolved:
        res = simulate(RunConfig(**config))
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        os.replace(tmp, target)
    return str(target)


def run_simulations(jobs: list[tuple[Hashable, int, dict, Path]], workers: int) -> dict[Hashable, dict[int, dict]]:
    """Run (group, seed, config, cache file) jobs in that order of submission; results[group][seed]."""
    results: dict[Hashable, dict[int, dict]] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(simulate_cached, config, str(path)): (group, seed) for group, seed, config, path in jobs}
        for fut in tqdm(as_completed(futures), total=len(futures), desc="runs", file=sys.stderr):
            group, seed = futures[fut]
            results.setdefault(group, {})[seed] = json.loads(Path(fut.result()).read_text())
    return results


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_curve(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """Pointwise mean over seeds of (x, y) curves; x from the first (a shorter curve drops out)."""
    xs = [x for x, _ in curves[0]]
    return xs, [sum(c[i][1] for c in curves if i < len(c)) / sum(1 for c in curves if i < len(c)) for i in range(len(xs))]
