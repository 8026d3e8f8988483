"""Distillation losses with the conventions of ALGORITHMS.md: KL(target || student), batchmean."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_to_student(target_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(target/E) || softmax(student/E)), averaged over the batch.

    Its gradient w.r.t. the student logits is (softmax(student/E) - softmax(target/E)) / (E * B).
    """
    target = F.softmax(target_logits.detach() / temperature, dim=1)
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    # F.kl_div(log_student, target, reduction="batchmean") written out as ATen computes it (the
    # same values bit for bit), because torch.func.vmap has no batching rule for kl_div and the
    # vectorized clients (stacked.py) would fall back to a loop over clients
    return (torch.xlogy(target, target) - target * log_student).sum() / log_student.size(0)


def kl_per_row(target_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(target/E) || softmax(student/E)) of each row: kl_to_student before its mean (for
    losses that weigh each sample, as differentially private training needs)."""
    target = F.softmax(target_logits.detach() / temperature, dim=1)
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    return (torch.xlogy(target, target) - target * log_student).sum(dim=1)


def kl_grad_wrt_student(target_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Closed form of d kl_to_student / d student_logits (used for cheap diagnostics)."""
    b = student_logits.shape[0]
    diff = F.softmax(student_logits.detach() / temperature, dim=1) - F.softmax(target_logits.detach() / temperature, dim=1)
    return diff / (temperature * b)


def mean_kl_to_mean(probs: torch.Tensor) -> float:
    """Output discrepancy between clients: mean over clients and rows of KL(p_n || mean_m p_m).

    probs: [N, B, K] probabilities of N clients on the same B rows.
    """
    p = probs.clamp_min(1e-12)
    mean = p.mean(dim=0, keepdim=True)
    return float((p * (p.log() - mean.log())).sum(dim=2).mean())
