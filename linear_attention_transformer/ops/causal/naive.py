"""The causal kernels' judge: the explicit (n x n) decayed weight matrix."""

from __future__ import annotations

import torch
from einops import rearrange

from ..common import NEG_INF
from ..segments import same_segment

__all__ = ["naive_causal_linear_attention"]


def naive_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False,
                                  segments=None):
    """Reference for the causal kernels: the explicit (n x n) decayed weight matrix.

    w_ij = sum_d q_id k_jd exp(G_id - G_jd) for visible j, G = cumsum(log_decay); with
    ``exp_features`` q_id k_jd is exp(q_id + k_jd), formed in log space (logsumexp over d,
    softmax over j). Key j is visible to query i when j <= i, or with ``blindspot_size`` B > 1
    when j // B < i // B; with ``segments`` (b, n) also only in i's segment (blocks counted
    from position 0).
    """
    b, h, n, d = q.shape
    block = torch.arange(n, device=q.device) // blindspot_size  # (blindspot_size 1: the position)
    visible = block[None, :] < block[:, None] if blindspot_size > 1 else block[None, :] <= block[:, None]
    if mask is not None:
        visible = visible & rearrange(mask, "b j -> b 1 1 j")
    if segments is not None:
        visible = visible & same_segment(segments)
    pair = q[:, :, :, None, :], k[:, :, None, :, :]  # (b, h, i, j, d) by broadcasting
    if log_decay is not None:
        if log_decay.ndim == 3:
            log_decay = log_decay[..., None].expand(b, h, n, d)
        if mask is not None:
            log_decay = log_decay.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0)
        G = log_decay.cumsum(dim=2)
        decay = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~visible[..., None], NEG_INF)
    else:
        decay = torch.zeros(1, dtype=q.dtype, device=q.device).masked_fill(~visible[..., None], NEG_INF)
    if exp_features:
        # invisible pairs and rows that see nothing get finite stand-ins, masked again after:
        # a logsumexp or softmax over only -inf has a NaN gradient (0 * NaN), even unused
        logits = pair[0] + pair[1] + decay.masked_fill(~visible[..., None], 0.0)
        log_w = torch.logsumexp(logits, dim=-1).masked_fill(~visible, NEG_INF)
        seen = visible.any(dim=-1, keepdim=True)
        w = log_w.masked_fill(~seen, 0.0).softmax(dim=-1).masked_fill(~seen, 0.0)  # sees nothing: 0
        return w @ v
    w = (pair[0] * pair[1] * decay.exp()).sum(-1)
    out = w @ v
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, out / torch.where(den > 0, den, 1), 0)

