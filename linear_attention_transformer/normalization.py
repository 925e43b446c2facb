"""The normalisation before every branch and before the output: LayerNorm, or RMSNorm as Llama has it.

RMSNorm (Zhang & Sennrich 2019) scales x by the root of its mean square, with no centring and
no bias: y = w * x / sqrt(mean(x²) + eps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x²) + eps) over the last axis; the statistics in at least
    float32 (a half-precision sum of squares overflows), the result in x's dtype before the
    weight multiplies it. x (..., dim) -> (..., dim)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


def check_norm(norm, eps):
    """ValueError / TypeError unless ``norm`` names a normalisation and ``eps`` is a positive float."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"norm_eps must be a positive number, got {eps!r}")


def make_norm(norm, dim, eps):
    """The module ``norm`` names ('layernorm' or 'rmsnorm') over ``dim`` features."""
    return RMSNorm(dim, eps) if norm == "rmsnorm" else nn.LayerNorm(dim, eps=eps)
