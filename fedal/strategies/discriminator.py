"""FedAL's server-side discriminator h(p; w): R^K -> R^N (paper section IV-A, VI-A).

An MLP over the tempered client probabilities; the paper's "32 and 265 neurons" is taken
as hidden widths 32 and 256 (configurable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Discriminator(nn.Module):
    def __init__(self, num_classes: int, num_clients: int, hidden: list[int]):
        super().__init__()
        self.num_clients = num_clients
        layers: list[nn.Module] = []
        width = num_classes
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_clients))
        self.net = nn.Sequential(*layers)

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return self.net(probs)


def discriminator_input(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits / temperature, dim=1)


# The discriminator's output is [rows, N] for N x B rows: at N = 1000 clients and B = 32 each
# such tensor is 128 MB, and a step holds several. Above this many output elements the rows go
# through in chunks (each row's output and gradient are its own; below it, one pass as always).
MAX_OUTPUT_ELEMENTS = 1 << 22


def row_chunks(rows: int, num_clients: int) -> list[slice]:
    """Slices of the rows whose [chunk, num_clients] outputs stay within MAX_OUTPUT_ELEMENTS."""
    per = max(1, MAX_OUTPUT_ELEMENTS // max(1, num_clients))
    return [slice(start, min(start + per, rows)) for start in range(0, rows, per)] or [slice(0, 0)]


def per_sample_adversarial_grad(
    disc: Discriminator, logits: torch.Tensor, client_index: torch.Tensor, temperature: float
) -> torch.Tensor:
    """G[b] = d U_n / d f_n[b] with U_n = -CE(n, h(softmax(f_n / E_d))), per sample (no 1/B).

    U is summed over rows, so each row's gradient is that row's own per-sample gradient;
    the gradient flows through the tempered softmax.
    """
    chunks = row_chunks(len(logits), disc.num_clients)
    grads = []
    for rows in chunks:
        f = logits[rows].detach().clone().requires_grad_(True)
        u = -F.cross_entropy(disc(discriminator_input(f, temperature)), client_index[rows], reduction="sum")
        grads.append(torch.autograd.grad(u, f)[0])
    return grads[0] if len(grads) == 1 else torch.cat(grads)
