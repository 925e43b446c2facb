"""Feature maps: how queries and keys become the non-negative features of linear attention.

``'softmax'`` (seed 000): queries take a softmax over their feature dimension. Keys take a
softmax over the sequence when nothing is causal; in the causal case they are exponentiated,
exp(k), because a softmax over the sequence would see the future.

exp(k) overflows for large logits. ``exp_keys_with_running_max`` subtracts the running
maximum m_t = max_{j <= t, d} k_jd instead: key j enters the state as exp(k_j - m_j) and the
state is rescaled by exp(m_{t-1} - m_t) <= 1 whenever the maximum grows. Every weight seen
by query t is then multiplied by the same exp(-m_t), which cancels between numerator and
denominator: the result is exact, and the rescaling is just a scalar decay of the
recurrence, handled by the same kernels as the forget gate.

``'elu'`` (elu + 1, "Transformers are RNNs"), ``'relu'`` and any callable (seed 001's
``psi_fn``) are applied to queries and keys alike.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from einops import rearrange

from .linear_attention import _check_mask

__all__ = ["FeatureMap", "exp_keys_with_running_max", "FEATURE_MAP_NAMES"]

FEATURE_MAP_NAMES = ("softmax", "elu", "relu")


def exp_keys_with_running_max(k, mask=None, running_max=None):
    """Causal exp(k) features, stabilised by the running maximum.

    Args:
        k: (b, h, n, d) key logits.
        mask: optional (b, n) bool, True for real tokens; padding never sets the maximum.
        running_max: optional (b, h) maximum carried over from earlier tokens (decoding).
    Returns:
        features exp(k_t - m_t) (b, h, n, d) (exactly 0 for padding), log_decay
        m_{t-1} - m_t (b, h, n), and m after the last token (b, h), -inf while no real key
        has been seen. All without gradient through m: the result does not depend on m.
    """
    _check_mask(mask, k.shape[0], k.shape[2])
    with torch.no_grad():
        kmax = k.detach().amax(dim=-1)  # (b, h, n)
        if mask is not None:
            kmax = kmax.masked_fill(~rearrange(mask, "b n -> b 1 n"), float("-inf"))
        if running_max is not None:
            kmax = torch.cat((running_max[..., None].to(kmax.dtype), kmax), dim=-1)
        m = kmax.cummax(dim=-1).values
        last = m[..., -1]  # -inf when no real key was seen: nothing to carry yet
        if not torch.isfinite(m).all():
            # before the first real key the state is empty: any finite scale will do, so
            # take the first real key's maximum (or 0 when there is none).
            first = torch.where(torch.isfinite(m), m, float("inf")).amin(dim=-1, keepdim=True)
            first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
            m = torch.where(torch.isfinite(m), m, first)
        if running_max is not None:
            prev, m = m[..., :-1], m[..., 1:]
        else:
            prev = F.pad(m[..., :-1], (1, 0))
            prev[..., 0] = m[..., 0]
        log_decay = prev - m
    logits = k - m[..., None]
    if mask is not None:
        # padding is not bounded by m: exp of it could be inf (and its gradient NaN)
        logits = logits.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), float("-inf"))
    return logits.exp(), log_decay, last


class FeatureMap:
    """A named or user-given feature map.

    Args:
        kind: ``'softmax'``, ``'elu'``, ``'relu'``, or a callable applied elementwise to
            queries and keys (it must return non-negative values).
    """

    def __init__(self, kind: Union[str, Callable] = "softmax"):
        if isinstance(kind, FeatureMap):
            kind = kind.kind
        if not callable(kind) and kind not in FEATURE_MAP_NAMES:
            raise ValueError(f"feature_map must be one of {FEATURE_MAP_NAMES} or a callable, got {kind!r}")
        self.kind = kind

    def __repr__(self):
        return f"FeatureMap({getattr(self.kind, '__name__', self.kind)!r})"

    @property
    def is_softmax(self):
        return self.kind == "softmax"

    def _pointwise(self, x):
        if self.kind == "elu":
            # elu(x) + 1, but exp(x) for x <= 0 directly: (exp(x) - 1) + 1 cancels to 0 in
            # low precision (bfloat16 already for x < -5.5) and the key would vanish
            return torch.where(x > 0, x + 1, x.clamp(max=0).exp())
        if self.kind == "relu":
            return F.relu(x)
        return self.kind(x)

    def queries(self, q):
        return q.softmax(dim=-1) if self.is_softmax else self._pointwise(q)

    def noncausal_keys(self, k, mask: Optional[torch.Tensor] = None):
        """Key features for non-causal attention. Returns (features, normalize): with the
        softmax map every output row already sums to one."""
        _check_mask(mask, k.shape[0], k.shape[2])
        if not self.is_softmax:
            return self._pointwise(k), True
        if mask is not None:
            # -max rather than -inf: a row with every key masked stays finite (the kernel
            # zeroes masked keys afterwards, so that query gets 0)
            k = k.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), torch.finfo(k.dtype).min)
        return k.softmax(dim=-2), False

    def causal_keys(self, k, mask=None, running_max=None):
        """Key features for causal attention: (features, log_decay or None, running_max or None)."""
        _check_mask(mask, k.shape[0], k.shape[2])
        if self.is_softmax:
            return exp_keys_with_running_max(k, mask, running_max)
        return self._pointwise(k), None, None
