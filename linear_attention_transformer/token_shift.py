"""Token shifting: a slice of each position's features is replaced by its neighbour's.

A cheap way to let every layer see the previous token directly, which speeds up
convergence of language models. In causal models the features are split in two: the
first half comes from the previous token, the second stays. Non-causal models split in
three: previous, next, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def token_shifts(causal: bool):
    return (1, 0) if causal else (1, -1, 0)


def shift_tokens(x, shifts, mask=None, previous=None, segments=None):
    """Shift slices of the feature dimension along the sequence.

    Args:
        x: (b, n, d). shifts: one shift per slice, e.g. (1, 0): slice 0 comes from the
            token before, slice 1 stays.
        mask: optional (b, n) bool; padding is zeroed first so it never leaks into a
            real token.
        previous: optional (b, d) features of the token before x[:, 0] (cached decoding).
        segments: optional (b, n) segment ids (a run index, ``ops/segments.py``): a token
            shifted across a segment boundary arrives as zeros, as at a sequence's ends.
    Returns:
        (b, n, d)
    """
    if mask is not None:
        x = x.masked_fill(~rearrange(mask, "b n -> b n 1"), 0.0)
    if segments is not None and previous is not None:
        raise ValueError("shift_tokens: segments and previous (cached decoding) cannot be combined")
    if previous is not None:
        x = torch.cat((rearrange(previous, "b d -> b 1 d"), x), dim=1)
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


def shift_step(h, previous):
    """One token of causal shifting (shifts (1, 0)), in place: h (b, d) -> its first slice
    replaced by ``previous`` (b, d), the token before; ``previous`` then holds h, for the next
    token. Equal to ``shift_tokens(h[:, None], (1, 0), previous=previous)[:, 0]``."""
    first = _slice_sizes(h.shape[-1], 2)[0]
    out = torch.cat((previous[:, :first], h[:, first:]), dim=-1)
    previous.copy_(h)
    return out
