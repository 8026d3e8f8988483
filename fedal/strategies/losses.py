"""Distillation losses with the conventions of ALGORITHMS.md: KL(target || student), batchmean."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def kl_to_student(target_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(target/E) || softmax(student/E)), averaged over the batch: [B, C] -> scalar, and
    [N, B, C] (N stacked clients, vectorized simulation) -> each client's value, [N].

    Its gradient w.r.t. the student logits is (softmax(student/E) - softmax(target/E)) / (E * B).
    """
    target = F.softmax(target_logits.detach() / temperature, dim=-1)
    log_student = F.log_softmax(student_logits / temperature, dim=-1)
    # F.kl_div(log_student, target, reduction="batchmean") written out as ATen computes it (the
    # same values bit for bit), so that it also takes a leading client axis
    return (torch.xlogy(target, target) - target * log_student).flatten(-2).sum(-1) / log_student.size(-2)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy's batch mean: [B, C] -> scalar, and [N, B, C] with labels [N, B] -> each
    client's mean, [N]."""
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels)
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape).mean(-1)


def kl_per_row(target_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(target/E) || softmax(student/E)) of each row: kl_to_student before its mean (for
    losses that weigh each sample, as differentially private training needs)."""
    target = F.softmax(target_logits.detach() / temperature, dim=1)
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    return (torch.xlogy(target, target) - target * log_student).sum(dim=1)


def kl_grad_norms(targets: Sequence[torch.Tensor], student_logits: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """The Euclidean norm of d kl_to_student(target, student) / d student_logits for each target,
    from its closed form (cheap diagnostics; one softmax over all of them): [B, C] logits ->
    [len(targets)], and [N, B, C] -> [len(targets), N]."""
    with torch.no_grad():
        b = student_logits.size(-2)
        z = torch.stack([student_logits, *targets])
        probs = F.softmax(z if temperature == 1 else z / temperature, dim=-1)  # x / 1 is x: skipped
        return torch.linalg.vector_norm((probs[:1] - probs[1:]) / (temperature * b), dim=(-2, -1))


def mean_kl_to_mean(probs: torch.Tensor) -> float:
    """Output discrepancy between clients: mean over clients and rows of KL(p_n || mean_m p_m).

    probs: [N, B, K] probabilities of N clients on the same B rows.
    """
    p = probs.clamp_min(1e-12)
    mean = p.mean(dim=0, keepdim=True)
    return float((p * (p.log() - mean.log())).sum(dim=2).mean())
