"""Differential privacy for what a client computes from its private data.

DP-SGD for the training steps on private data (Poisson sampling, per-sample clipping, Gaussian
noise; Opacus computes the per-sample gradients) and one accountant per client that composes
every release. Everything a client derives from a differentially private model afterwards
(logits on the public set, steps on the public set) is post-processing and costs nothing.
Opacus is the optional `privacy` extra: it is imported only when a run turns privacy on.
"""

from fedal.privacy.accountant import PrivacyAccountant
from fedal.privacy.settings import PrivacyParams
from fedal.privacy.training import PrivacyBudgetExhausted, PrivacyUnavailable, PrivateTraining, dp_compatible, require_opacus

__all__ = ["PrivacyAccountant", "PrivacyBudgetExhausted", "PrivacyParams", "PrivacyUnavailable", "PrivateTraining",
           "dp_compatible", "require_opacus"]
