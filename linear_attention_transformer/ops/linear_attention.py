"""Non-causal linear attention, q (kᵀv), with the plain reference it must equal.

The attention weight of key j for query i is w_ij = phi(q_i) . phi(k_j), and the output is
``sum_j w_ij v_j / sum_j w_ij``: one kᵀv summary (d x e, with the normaliser as an extra
all-ones column of v) that every query reads. The causal kernels are in ``ops/causal/``.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .common import append_ones, apply_key_mask, check_mask, compute_dtype, divide_by_normaliser
from .segments import same_segment, segment_one_hot, segment_runs

__all__ = ["linear_attention", "linear_attention_summary", "linear_attention_readout", "naive_linear_attention"]


def linear_attention(q, k, v, mask=None, normalize=True, segments=None):
    """Non-causal linear attention, q (kᵀv), in O(n d e).

    Args:
        q: (b, h, n, d) query features.
        k: (b, h, m, d) key features (non-negative when ``normalize``).
        v: (b, h, m, e) values.
        mask: optional (b, m) bool, True for keys to attend to.
        normalize: divide by sum_j w_ij (off for maps whose rows already sum to 1).
        segments: optional (b, n) ids (self-attention, m == n): each query reads only its
            own segment's kᵀv, in O(n S d e) for S segments per row.
    Returns:
        (b, h, n, e)
    """
    if segments is None:
        return linear_attention_readout(q, linear_attention_summary(k, v, mask, normalize))
    # one kᵀv per segment (S, b, h, d, e), of its own keys (the others zeroed), read by every
    # query; each query keeps its own segment's
    member = rearrange(segment_one_hot(segment_runs(segments), compute_dtype(k)), "b s n -> s b 1 n 1")
    out = linear_attention_readout(q, linear_attention_summary(k * member, v, mask, normalize))
    return (out * member).sum(dim=0).to(q.dtype)


def linear_attention_summary(k, v, mask=None, normalize=True):
    """The keys and values reduced to kᵀv: (…, b, h, d, e), or (…, b, h, d, e + 1) with the
    normaliser column when ``normalize``; k (…, b, h, m, d) (leading axes: one summary each),
    v (b, h, m, e). A decoder computes it once per context."""
    check_mask(mask, k.shape[-4], k.shape[-2])
    dtype = compute_dtype(k)
    with torch.autocast(k.device.type, enabled=False):
        k, v = k.to(dtype), v.to(dtype)
        k, v, _ = apply_key_mask(k, v, None, mask, exp_features=False)
        if normalize:
            v = append_ones(v)
        summary = torch.einsum("...md,...me->...de", k, v)
    return summary, normalize


def linear_attention_readout(q, summary):
    """Queries read a ``linear_attention_summary``: (b, h, n, d) -> (…, b, h, n, e)."""
    kv, normalize = summary
    with torch.autocast(q.device.type, enabled=False):
        out = torch.einsum("...nd,...de->...ne", q.to(kv.dtype), kv)
        if normalize:
            out = divide_by_normaliser(out)
    return out.to(q.dtype)


def naive_linear_attention(q, k, v, mask=None, normalize=True, segments=None):
    """Reference for ``linear_attention``: the explicit (n x m) weight matrix (with
    ``segments``, zero between tokens of different segments)."""
    w = torch.einsum("bhnd,bhmd->bhnm", q, k)
    if mask is not None:
        w = w.masked_fill(~rearrange(mask, "b m -> b 1 1 m"), 0.0)
    if segments is not None:
        w = w.masked_fill(~same_segment(segments), 0.0)
    out = torch.einsum("bhnm,bhme->bhne", w, v)
    if normalize:
        den = w.sum(-1, keepdim=True)
        out = torch.where(den > 0, out / torch.where(den > 0, den, 1), 0)
    return out

