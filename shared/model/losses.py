"""The training objectives of both levels and of the head replay, as pure functions.

Past (frozen) classes always come first in the seen-class order, so "past" is a prefix of
``n_past`` rows or columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOGIT_NORM_TEMPERATURE = 0.1
LOGIT_NORM_EPS = 1e-7


def mask_past(logits: torch.Tensor, n_past: int) -> torch.Tensor:
    """Set the first ``n_past`` columns to −inf (past classes take no part in a task's CE)."""
    if n_past == 0:
        return logits
    return torch.cat([torch.full_like(logits[:, :n_past], float("-inf")), logits[:, n_past:]], 1)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, n_past: int) -> torch.Tensor:
    """CE over the seen classes with past columns masked."""
    return F.cross_entropy(mask_past(logits, n_past), labels)


def prompt_orthogonality_loss(current: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """L_OP: mean over (current, past) pairs of (p_c · p_c')²; 0 when there is no past."""
    if past.shape[0] == 0 or current.shape[0] == 0:
        return current.new_zeros(())
    return ((current.flatten(1) @ past.detach().flatten(1).t()) ** 2).mean()


def query_orthogonality_loss(current: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """L_OQ for Q [C, L, d]: per block, unit norm of current rows plus orthogonality to past.

    (1/L) Σ_l [ mean_c (‖Q_c,l‖² − 1)² + mean_{c,c'} (Q_c,l · Q_c',l)² ]; 0 at the first task,
    as in the reference (the norm term is skipped too when there is no past).
    """
    if past.shape[0] == 0 or current.shape[0] == 0:
        return current.new_zeros(())
    norm_term = ((current**2).sum(-1) - 1) ** 2  # [Cc, L]
    cross = torch.einsum("cld,kld->lck", current, past.detach()) ** 2  # [L, Cc, Cp]
    return (norm_term.mean(0) + cross.mean((1, 2))).mean()


def logit_norm(logits: torch.Tensor) -> torch.Tensor:
    """LogitNorm of the head replay: ℓ / (0.1 · (‖ℓ‖₂ + 1e−7)), norm over classes."""
    norm = logits.norm(p=2, dim=-1, keepdim=True) + LOGIT_NORM_EPS
    normed: torch.Tensor = logits / (LOGIT_NORM_TEMPERATURE * norm)
    return normed
