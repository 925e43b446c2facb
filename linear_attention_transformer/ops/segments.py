"""Packed sequences: several documents in one row, told apart by ``segment_ids``.

A segment is a maximal run of equal consecutive ids (``[0, 0, 1, 1, 0]`` holds three). Every
layer treats each as a sequence of its own: no token sees another segment's, and positions
restart at each segment's first token. The ids are canonicalised to a *run index*,
``cumsum(id changes)``, which every function below also accepts (``segment_runs`` is idempotent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "check_integer_ids", "check_segment_ids", "segment_runs", "positions_in_segment", "segment_softmax", "segment_one_hot",
    "aligned_layout", "to_layout", "from_layout",
]


# the dtypes of ids: integers, signed or unsigned, of any width (bool is not one)
INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                            torch.uint64})


def is_integer_dtype(dtype):
    """Whether ``dtype`` holds integers (signed or unsigned, any width; bool is not one)."""
    return dtype in INTEGER_DTYPES


def check_integer_ids(ids, name):
    """TypeError unless ``ids`` (token or segment ids) is a tensor of an integer dtype."""
    if not torch.is_tensor(ids) or not is_integer_dtype(ids.dtype):
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")


def check_segment_ids(segment_ids, shape, name="segment_ids"):
    """TypeError unless an integer tensor, ValueError unless of ``shape`` (batch, seq_len)."""
    if segment_ids is None:
        return
    check_integer_ids(segment_ids, name)
    if tuple(segment_ids.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape (batch, seq_len) = {tuple(shape)}, got {tuple(segment_ids.shape)}")


def segment_runs(segment_ids):
    """(b, n) ids -> (b, n) long run index: 0 at the first token, +1 at every id change."""
    changes = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
    return F.pad(changes.cumsum(dim=1), (1, 0))


def positions_in_segment(runs):
    """(b, n) run index -> (b, n) long: each token's index inside its segment."""
    position = torch.arange(runs.shape[1], device=runs.device).expand_as(runs)
    starts = F.pad(runs[:, 1:] != runs[:, :-1], (1, 0), value=True)
    return position - torch.where(starts, position, 0).cummax(dim=1).values


def same_segment(segments):
    """(b, n) ids -> (b, 1, n, n) bool: query i and key j lie in the same segment."""
    runs = segment_runs(segments)
    return (runs[:, :, None] == runs[:, None, :])[:, None]


def segment_one_hot(runs, dtype):
    """(b, n) run index -> (b, S, n) membership of each token in each of S segments
    (S = the largest segment count of a row; reading it is a device sync)."""
    count = int(runs[:, -1].max()) + 1 if runs.shape[1] else 1
    return F.one_hot(runs, count).to(dtype).transpose(1, 2)


def segment_softmax(x, segments):
    """Softmax of x (b, h, n, d) over the sequence within each segment; ``segments`` (b, n)
    ids or run index."""
    b, h, n, d = x.shape
    index = segment_runs(segments)[:, None, :, None].expand(b, h, n, d)  # (ids are not indices)
    with torch.no_grad():  # the shift cancels: no gradient
        top = torch.full_like(x, float("-inf")).scatter_reduce(2, index, x.detach(), "amax", include_self=True)
        top = top.gather(2, index)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = (x - top).exp()
    total = torch.zeros_like(e).scatter_add(2, index, e).gather(2, index)
    return e / total


def aligned_layout(runs, alignment):
    """Where each token goes when every segment is moved to start at a multiple of
    ``alignment`` (the slots between stay empty). runs: (b, n) run index.
    Returns (slots (b, n) long, length): the token's slot, and the layout's length (the
    longest row's; reading it is a device sync). Costs at most alignment - 1 empty slots
    per segment."""
    b, n = runs.shape
    lengths = torch.zeros(b, n, dtype=torch.long, device=runs.device).scatter_add_(1, runs, torch.ones_like(runs))
    padded = -(-lengths // alignment) * alignment  # per run index; 0 past the row's last segment
    starts = padded.cumsum(dim=1) - padded
    slots = starts.gather(1, runs) + positions_in_segment(runs)
    return slots, int(padded.sum(dim=1).max())


def to_layout(t, slots, length, fill=0):
    """(b, n, ...) -> (b, length, ...): token i to slot ``slots[:, i]``, ``fill`` elsewhere."""
    index = slots.view(*slots.shape, *(1,) * (t.ndim - 2)).expand_as(t)
    return torch.full((t.shape[0], length, *t.shape[2:]), fill, dtype=t.dtype, device=t.device).scatter(1, index, t)


def from_layout(t, slots):
    """Inverse of ``to_layout``: (b, length, ...) -> (b, n, ...)."""
    return t.gather(1, slots.view(*slots.shape, *(1,) * (t.ndim - 2)).expand(*slots.shape, *t.shape[2:]))
