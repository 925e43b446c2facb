"""Token shifting: a slice of each position's features is replaced by its neighbour's, so every
layer sees the previous token directly. Causal: two slices (previous, unchanged); else three
(previous, next, unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def token_shifts(causal: bool):
    return (1, 0) if causal else (1, -1, 0)


def shift_tokens(x, shifts, mask=None, previous=None, segments=None, keep=None):
    """Shift slices of the feature dimension along the sequence: x (b, n, d) -> (b, n, d).

    ``shifts``: one per slice, e.g. (1, 0): slice 0 from the token before, slice 1 stays.
    ``mask`` (b, n): padding is zeroed first. ``previous`` (b, d): the token before x[:, 0]
    (cached decoding); ``keep``: a (b, d) buffer given x's last token (zero if padding), the
    next call's ``previous``. ``segments`` (b, n) run index: nothing shifts across a boundary
    (zeros arrive, as at the sequence's ends)."""
    if mask is not None:
        x = x.masked_fill(~rearrange(mask, "b n -> b n 1"), 0.0)
    if segments is not None and previous is not None:
        raise ValueError("shift_tokens: segments and previous (cached decoding) cannot be combined")
    if previous is not None:
        x = torch.cat((rearrange(previous, "b d -> b 1 d"), x), dim=1)
    if keep is not None:
        with torch.no_grad():  # (a cache carries no gradient)
            keep.copy_(x[:, -1])
    parts = []
    sizes = _slice_sizes(x.shape[-1], len(shifts))
    for part, s in zip(x.split(sizes, dim=-1), shifts):
        # padding by (s, -s) along the sequence moves the slice s places later
        shifted = F.pad(part, (0, 0, s, -s)) if s else part
        if s and segments is not None:
            shifted = shifted.masked_fill(rearrange(F.pad(segments, (s, -s), value=-1) != segments, "b n -> b n 1"), 0.0)
        parts.append(shifted)
    out = torch.cat(parts, dim=-1)
    return out[:, 1:] if previous is not None else out


def _slice_sizes(dim, count):
    """The widths of the ``count`` feature slices (the last takes the remainder)."""
    return [dim // count] * (count - 1) + [dim - dim // count * (count - 1)]
