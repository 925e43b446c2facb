"""Windowed softmax attention by absolute position: what a local head computes.

The sequence is cut into windows of w tokens; window u = i // w holds query i. The rule of the
``local-attention`` package (``local_attention.LocalAttention``): query i sees key j when j's window lies between L
windows before and F windows after its own (L = look_backward, F = look_forward),

    i // w - L  <=  j // w  <=  i // w + F,     and j <= i when causal (then F = 0).

With ``exact`` (causal only) the window slides with the query instead of jumping by blocks:
query i sees exactly the last L * w keys, itself included,

    i - L * w  <  j  <=  i.

``Window.visible`` states the rule once (lower bound ``Window.first_key``).
``windowed_attention_by_position`` is its plain O(n m) masked softmax (also cached decoding's,
keys in a ring at any positions), ``windowed_attention_step`` one decoder query over that ring,
and ``windowed_attention`` the local heads' 'windowed' implementation (``windowed_flex.py``'s
``local_implementation`` names the two), O(n (L + F + 1) w): each window of queries meets the
L + F + 1 windows of keys around it, masked by the same rule. A sequence shorter than w lies in
one window, whose queries see every key (causal: every earlier one): it is one block of n.

With ``segments`` (``segments.py``) positions count from each query's segment start and only
its own segment's keys are visible; ``windowed_attention`` then meets one more window each side.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

from .causal.forms import reads_back_here
from .non_finite import poisoned, quarantine
from .segments import positions_in_segment, segment_runs


class Window(NamedTuple):
    """A local head's window: size w, look_backward L, look_forward F, causal, exact."""

    size: int
    look_backward: int = 1
    look_forward: int = 0
    causal: bool = True
    exact: bool = False

    def visible(self, q_positions, k_positions):
        """Bool, broadcast of the two position tensors: key visible to query."""
        seen = k_positions >= self.first_key(q_positions)
        if self.causal:
            return seen & (k_positions <= q_positions)
        return seen & (k_positions // self.size <= q_positions // self.size + self.look_forward)

    def first_key(self, position):
        """The first key position a query at ``position`` (an int or a tensor) sees: the rule's
        lower bound, i - L w + 1 (exact) or the start of the window L windows back. A causal
        query at ``position`` or later sees no key before it."""
        w, L = self.size, self.look_backward
        return position - (L * w - 1) if self.exact else position - position % w - L * w

    @property
    def most_keys(self):
        """The most keys a causal query sees (what a decoder's ring of keys holds)."""
        return self.look_backward * self.size if self.exact else (self.look_backward + 1) * self.size


def windowed_attention_by_position(q, k, v, q_positions, k_positions, window, key_mask=None, q_segments=None,
                                   k_segments=None):
    """The explicit form: q (b, h, n, d) at ``q_positions`` (n,) or (b, n), k, v (b, h, m, d) at
    ``k_positions`` (m,) or (b, m), ``key_mask`` (b, m) True for real keys, ``q_segments`` /
    ``k_segments`` (b, n) / (b, m) labels (a key is visible only to queries of its label;
    positions are then segment-relative) -> (b, h, n, d)."""
    q, k, v, bad = quarantine_inputs(q, k, v)
    sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    visible = window.visible(q_positions[..., :, None], k_positions[..., None, :])
    if q_segments is not None:
        visible = visible & (q_segments[:, :, None] == k_segments[:, None, :])
    if visible.ndim == 3:
        visible = visible[:, None]
    if key_mask is not None:
        visible = visible & rearrange(key_mask, "b j -> b 1 1 j")
    return _softmax_attend(sim, visible, v, bad)


def windowed_attention(q, k, v, window, key_mask=None, segments=None):
    """The local heads' 'windowed' implementation over positions 0 .. n - 1: q, k, v (b, h, n,
    d), ``key_mask`` (b, n), ``segments`` (b, n) ids (each segment as if alone) -> (b, h, n, d).
    Each block of w queries meets the windows of keys around it (one more each side with
    segments), padded and masked."""
    b, _, n, _ = q.shape
    if n < window.size:  # one window holds the sequence, and sees all of it: blocks of n, not n padded to w
        window = window._replace(size=n, look_backward=0, look_forward=0, exact=False)
    w = window.size
    runs = None if segments is None else segment_runs(segments)
    packed = runs is not None
    before = window.look_backward + int(packed and not window.exact)
    after = window.look_forward + int(packed and not window.causal)
    if key_mask is None:
        key_mask = torch.ones(b, n, dtype=torch.bool, device=q.device)
    pad = -n % w
    span = (before + 1 + after) * w
    sides = (before * w, pad + after * w)
    q, k, v, bad = quarantine_inputs(q, k, v)
    q = rearrange(F.pad(q, (0, 0, 0, pad)), "b h (u i) d -> b h u i d", i=w)
    k, v = (rearrange(F.pad(t, (0, 0, *sides)).unfold(2, span, w), "b h u d j -> b h u j d") for t in (k, v))
    if bad is not None:  # the same blocks of the flags: queries (b, h, u, i), keys (b, h, u, j)
        bad = (rearrange(F.pad(bad[0], (0, pad)), "b h (u i) -> b h u i", i=w),
               F.pad(bad[1], sides).unfold(2, span, w))
    key_mask = F.pad(key_mask, sides, value=False).unfold(1, span, w)[:, :, None]  # (b, u, 1, j)
    if runs is None:
        q_positions = torch.arange(n + pad, device=q.device).view(-1, w, 1)  # (u, i, 1)
        k_positions = torch.arange(-before * w, n + pad + after * w, device=q.device).unfold(0, span, w)[:, None]
        visible = window.visible(q_positions, k_positions) & key_mask  # (b, u, i, j)
    else:
        positions = positions_in_segment(runs)
        q_positions, q_runs = (rearrange(F.pad(t, (0, pad)), "b (u i) -> b u i 1", i=w) for t in (positions, runs))
        k_positions = F.pad(positions, sides).unfold(1, span, w)[:, :, None]  # (b, u, 1, j)
        k_runs = F.pad(runs, sides, value=-1).unfold(1, span, w)[:, :, None]  # padding is no segment
        visible = window.visible(q_positions, k_positions) & (q_runs == k_runs) & key_mask
    sim = torch.einsum("bhuid,bhujd->bhuij", q, k) * q.shape[-1] ** -0.5
    out = _softmax_attend(sim, visible[:, None], v, bad)
    return rearrange(out, "b h u i d -> b h (u i) d")[:, :, :n]


def windowed_attention_step(q, keys, values, bias):
    """One query over a ring of stored keys (cached decoding): q (b, h, 1, d) scaled by d^-1/2,
    keys and values (b, h, slots, d), bias (b or 1, 1, slots) 0 where visible, -inf elsewhere
    -> (b, h, d). Products and sums, not matmuls: a batched
    matmul of tiny shapes runs on every thread, and waiting for a busy one costs milliseconds."""
    sim = (q * keys).sum(dim=-1) + bias
    return torch.sum(sim.softmax(dim=-1)[..., None] * values, dim=-2)


def quarantine_inputs(q, k, v):
    """``non_finite.quarantine`` of q, k, v: (q, k, v, None or (query flags (b, h, n), key or
    value flags (b, h, m))) for ``_softmax_attend``. Checked first by one value read back
    where that costs nothing (``forms.reads_back_here``)."""
    (q, k, v), bad = quarantine((q, k, v), check_first=reads_back_here(q.device))
    return q, k, v, None if bad is None else (bad[0], bad[1] | bad[2])


def _softmax_attend(sim, visible, v, bad=None):
    # the most negative finite value keeps a row with no visible key finite; its weights are
    # then zeroed, so such a query (a padded one in a causal model) gets 0 and reads no key:
    # a uniform row would spread over the window's later keys, against causality
    sim = sim.masked_fill(~visible, -torch.finfo(sim.dtype).max)
    out = sim.softmax(dim=-1).masked_fill(~visible, 0.0) @ v
    if bad is None:
        return out
    bad_query, bad_key = bad  # a query sees a bad key or value: NaN, as its plain sum is
    return poisoned(out, bad_query | (visible & bad_key[..., None, :]).any(dim=-1))
