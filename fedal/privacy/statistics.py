"""Private statistics: what a strategy computes directly from private data and sends (per-class
means of outputs or features) through the Gaussian mechanism over a clipped norm.

Per class j the release is the sum of the rows of class j, each clipped to L2 norm C, and the
class's count scaled by C. Adding or removing one sample changes one class's sum by at most C
and its scaled count by C: the release's L2 sensitivity is sqrt(2) C, whatever the data
(`sensitivity`). Gaussian noise of std sigma * sqrt(2) C on every entry makes it a Gaussian
mechanism of noise multiplier sigma, which the client's accountant composes as one step at
sample rate 1. The means and counts sent are post-processing of the noisy release: counts
rounded and floored at 0, a class whose noisy count is below 1 left out (row 0, count 0).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def clipped_class_sums(values: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float) -> torch.Tensor:
    """The release before noise, [K, d + 1]: per class the sum of its rows clipped to norm `clip`,
    then its count times `clip`."""
    values = values.reshape(len(values), -1).double()
    norms = values.norm(dim=1, keepdim=True)
    # a row that is not finite counts as a zero row (inf * 0 is NaN: the release would depend on it)
    finite = norms.isfinite()
    clipped = torch.where(finite, values, 0.0) * torch.where(finite, (clip / norms.clamp_min(1e-12)).clamp(max=1.0), 0.0)
    sums = torch.zeros(num_classes, values.shape[1], dtype=torch.float64).index_add_(0, labels, clipped)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes].double()
    return torch.cat([sums, clip * counts[:, None]], dim=1)


def sensitivity(clip: float) -> float:
    """The L2 sensitivity of clipped_class_sums to adding or removing one sample."""
    return math.sqrt(2.0) * clip


def private_count(count: int, sigma: float, generator: torch.Generator, most: int) -> int:
    """A count (sensitivity 1) through the Gaussian mechanism of noise multiplier sigma, rounded
    and kept within [0, most] (post-processing)."""
    noisy = count + (float(torch.normal(0.0, sigma, size=(1,), generator=generator, dtype=torch.float64)) if sigma > 0
                     else 0.0)
    return int(min(max(round(noisy), 0), most))


def private_class_means(values: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float, sigma: float,
                        generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Noisy per-class means [K, d] (float32) and counts [K] (int64) of `values` by `labels`."""
    release = clipped_class_sums(values, labels, num_classes, clip)
    if sigma > 0:
        release = release + torch.normal(0.0, sigma * sensitivity(clip), size=release.shape, generator=generator,
                                          dtype=torch.float64)
    sums, counts = release[:, :-1], release[:, -1] / clip
    kept = counts >= 1.0
    means = torch.where(kept[:, None], sums / counts.clamp_min(1.0)[:, None], torch.zeros_like(sums))
    return means.float().numpy(), torch.where(kept, counts.round(), torch.zeros_like(counts)).long().numpy()
