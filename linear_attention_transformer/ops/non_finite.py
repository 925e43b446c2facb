"""Non-finite inputs stay in their future.

An invisible key has weight 0, but 0 * NaN is NaN: a later token's NaN or inf would reach
earlier queries through every product that masks by multiplying. So the attention ops read
non-finite queries, keys, values and decays as 0 (``quarantine``) and give NaN to exactly the
outputs whose plain sum holds one: the query's own token and the keys, values and decays it
sees (``seen``). Every other output, and its gradient, is bit for bit as without the bad token.
Forms that may read back to the host first test the sum of everything (one reduction); the
others always take the full path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quarantine(tensors, check_first, real=None):
    """tensors: (…, n, d) or (…, n) tensors, or None. Returns (the tensors with every
    non-finite entry as 0, flags): flags None when all are finite, else per tensor a (…, n)
    bool, True where a token's entry is non-finite (and ``real``, broadcastable, holds: a
    padded token is never read, its values do not matter)."""
    given = [t for t in tensors if t is not None]
    if check_first and torch.isfinite(sum(t.sum() for t in given)):  # (a finite overflow goes on below)
        return tensors, None
    flags = []
    for t in tensors:
        if t is None:
            flags.append(None)
            continue
        bad = ~torch.isfinite(t)
        bad = bad.any(dim=-1) if t.ndim == 4 else bad
        flags.append(bad if real is None else bad & real)
    safe = [None if t is None else torch.where(torch.isfinite(t), t, 0.0) for t in tensors]
    return safe, flags


def seen(flags, until, start):
    """Whether any flag lies at a position in [start, until] (none when until < start), per
    position: flags (…, n) bool; until, start: long, broadcastable to flags (the last position
    a query reads, the first of its segment)."""
    n = flags.shape[-1]
    count = F.pad(flags.long().cumsum(dim=-1), (1, 0))  # count[t]: flags before position t
    shape = flags.shape[:-1] + (n,)
    upto = torch.gather(count, -1, torch.broadcast_to(until + 1, shape).clamp(min=0))
    before = torch.gather(count, -1, torch.broadcast_to(start, shape))
    return (until >= start) & (upto > before)


def poisoned(out, hit):
    """NaN in the outputs (…, n, e) of the queries where ``hit`` (…, n) holds."""
    return out.masked_fill(hit[..., None], float("nan"))
