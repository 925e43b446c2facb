"""Feature maps: how queries and keys become the non-negative features of linear attention.

``'softmax'`` (the default, as upstream): queries take a softmax over their features; keys a
softmax over the sequence without a causal order, else exp(k), which the causal kernels take
as logits (``exp_features=True``, exponentiated against maxima that cancel: ``ops/causal/chunk.py``).

``'elu'`` (elu + 1, "Transformers are RNNs"), ``'relu'`` and any callable (the
``linear-attention`` package's ``psi_fn``) are applied to queries and keys alike.

``'taylor'`` (the second-order Taylor map of Based, Arora et al. 2024) replaces exp(s), with
s = q·k / sqrt(d), by its Taylor polynomial 1 + s + s²/2, as the dot product of features:

    phi(x) = [1, x / d^(1/4), (x_i x_j / sqrt(d))_{i<j}, (x_i² / sqrt(2 d))_i]

so phi(q)·phi(k) = 1 + s + (sum_i q_i k_i)² / (2 d) = 1 + s + s²/2 = ((s + 1)² + 1) / 2 >= 1/2
(each pair i < j once, the squares halved): every key counts, no normaliser vanishes. d
features become 1 + d + d (d + 1) / 2 (153 for d = 16): meant for a small d (Based uses 16).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from einops import rearrange

from .common import check_mask
from .segments import segment_softmax

__all__ = ["FeatureMap", "FEATURE_MAP_NAMES"]

FEATURE_MAP_NAMES = ("softmax", "elu", "relu", "taylor")


def taylor_features(x):
    """phi(x) of the module docstring over the last dimension: (..., d) -> (..., 1 + d + d (d + 1) / 2),
    with phi(q)·phi(k) = 1 + s + s²/2, s = q·k / sqrt(d)."""
    d = x.shape[-1]
    i, j = torch.triu_indices(d, d, offset=1, device=x.device)
    return torch.cat((
        torch.ones_like(x[..., :1]),
        x * d ** -0.25,
        x[..., i] * x[..., j] * d ** -0.5,
        x.square() * (2 * d) ** -0.5,
    ), dim=-1)


def _elu_plus_one(x):
    """elu(x) + 1 as relu(x) + exp(min(x, 0)): (exp(x) - 1) + 1 would cancel to 0 in low
    precision (bfloat16 for x < -5.5, float32 for x < -17) and the key vanish."""
    return x.clamp(max=0).exp_().add_(x.clamp(min=0))


class _EluPlusOne(torch.autograd.Function):
    """``_elu_plus_one`` with a backward that reads only the output y: the slope is min(y, 1)
    (two passes in backward, where autograd through the two halves made five)."""

    generate_vmap_rule = True  # (and forward apart from setup_context: torch.func works)

    @staticmethod
    def forward(x):
        return _elu_plus_one(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y.clamp(max=1)


class FeatureMap:
    """A named or user-given feature map.

    Args:
        kind: ``'softmax'``, ``'elu'``, ``'relu'``, ``'taylor'``, or a callable applied
            elementwise to queries and keys (it must return non-negative values).
    """

    def __init__(self, kind: Union[str, Callable] = "softmax"):
        if isinstance(kind, FeatureMap):
            kind = kind.kind
        if not callable(kind) and kind not in FEATURE_MAP_NAMES:
            raise ValueError(f"feature_map must be one of {FEATURE_MAP_NAMES} or a callable, got {kind!r}")
        self.kind = kind
        self.is_softmax = kind == "softmax"

    def __repr__(self):
        return f"FeatureMap({getattr(self.kind, '__name__', self.kind)!r})"

    def feature_dim(self, d):
        """The number of features of a head of d query / key dimensions (taylor: 1 + d + d (d + 1) / 2)."""
        return 1 + d + d * (d + 1) // 2 if self.kind == "taylor" else d

    def pointwise(self, x):
        """The features of queries or keys over the last dimension (all but 'softmax';
        elementwise for all but 'taylor', which maps d to ``feature_dim(d)``)."""
        if self.kind == "taylor":
            return taylor_features(x)
        if self.kind == "elu":
            return _EluPlusOne.apply(x) if x.requires_grad else _elu_plus_one(x)
        if self.kind == "relu":
            return F.relu(x)
        return self.kind(x)

    def queries(self, q):
        return q.softmax(dim=-1) if self.is_softmax else self.pointwise(q)

    def noncausal_keys(self, k, mask: Optional[torch.Tensor] = None, segments: Optional[torch.Tensor] = None):
        """Key features for non-causal attention. Returns (features, normalize): with the
        softmax map every output row already sums to one. With ``segments`` (a (b, n) run
        index, ``segments.py``) the softmax runs over each segment's keys."""
        check_mask(mask, k.shape[0], k.shape[2])
        if not self.is_softmax:
            return self.pointwise(k), True
        if mask is not None:
            # -max rather than -inf: a row with every key masked stays finite (the kernel
            # zeroes masked keys afterwards, so that query gets 0)
            k = k.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), torch.finfo(k.dtype).min)
        return (k.softmax(dim=-2) if segments is None else segment_softmax(k, segments)), False

    def causal_features(self, q, k):
        """Query and key inputs of the causal kernels: (q, k, exp_features); the softmax map
        hands over the logits (the module docstring)."""
        if self.is_softmax:
            return q, k, True
        return self.pointwise(q), self.pointwise(k), False
