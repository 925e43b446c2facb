"""The delta rule's judge: the recurrence as written, with explicit (d x d) matrices."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import check_mask

__all__ = ["naive_delta_rule"]


def naive_delta_rule(q, k, v, beta, log_decay=None, mask=None, state=None, segments=None):
    """S_t = a_t (I - b_t k_t k_tᵀ) S_{t-1} + b_t k_t v_tᵀ and o_t = S_tᵀ q_t, one token at a time.

    Args:
        q, k: (b, h, n, d); v: (b, h, n, e); beta: (b, h, n) b_t; log_decay: (b, h, n) log a_t
            or None (a_t = 1).
        mask: (b, n) bool or None: a masked token leaves the state as it was.
        state: (b, h, d, e) S before the first token, or None (zeros).
        segments: (b, n) ids or None: the state is emptied at each segment's first token after
            position 0.
    Returns:
        (o (b, h, n, e), S after the last token (b, h, d, e)).
    """
    b, h, n, d = q.shape
    check_mask(mask, b, n)
    S = q.new_zeros(b, h, d, v.shape[-1]) if state is None else state
    eye = torch.eye(d, dtype=q.dtype, device=q.device)
    starts = None if segments is None else F.pad(segments[:, 1:] != segments[:, :-1], (1, 0))
    outs = []
    for t in range(n):
        if starts is not None:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        kt, bt = k[:, :, t, :, None], beta[:, :, t, None, None]  # (b, h, d, 1), (b, h, 1, 1)
        a = 1.0 if log_decay is None else log_decay[:, :, t, None, None].exp()
        new = a * (eye - bt * kt @ kt.transpose(-1, -2)) @ S + bt * kt @ v[:, :, t, None, :]
        S = new if mask is None else torch.where(mask[:, t, None, None, None], new, S)
        outs.append((S.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2), S
