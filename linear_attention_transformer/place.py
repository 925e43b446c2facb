"""Where a sequence sits: one object, made once per forward and read by every layer.

A forward runs x (b, n, …) in one of four modes:

* plain: x is a whole sequence, its first token at position 0;
* cached: x continues a sequence after ``position`` earlier tokens, and every layer reads and
  updates its cache (``cache.py``); one token per row while no gradient is recorded is a
  ``step``, where each stateful layer takes its recurrent form. A step reads the position back
  to the host only eagerly on a CPU, where that costs no wait; elsewhere, and when traced, it
  reads the cache's tensor alone (one traced graph for every position);
* packed: x holds several sequences per row, ``segments`` (``ops/segments.py``);
* context parallel: x is one rank's slice of a sequence split over ``group``
  (``context_parallel.py``), its first token at ``group.start``.

Positions count per row from the row's first real token: when the first call of a sequence
has rows padded on the left (``input_mask``), ``row_starts`` holds each row's first real
column, so that such a row computes what it computes alone (a cache keeps it for the calls
that continue the sequence).

The modes exclude each other, and ``Place.of`` checks that once, where the object is made.
What a given layer cannot do in a mode (Linformer with packed sequences, a window longer than
a slice) is that layer's to refuse, in the ``check`` it hands to ``Place.of``, which runs
before any communication.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .context_parallel import ContextParallel
from .ops.segments import check_segment_ids, positions_in_segment, segment_runs


@dataclasses.dataclass(frozen=True)
class Place:
    """Where x sits (see the module docstring).

    Attributes:
        position: the tokens before x in its sequence (a cache's position; 0 without one). On a
            ``step`` the count on the host where reading it back costs no wait (eager, on a
            CPU), else None: the step then reads only ``tensor``.
        cached: whether the layers continue from their caches and update them.
        step: one token per row continuing a cache, no gradient recorded: the recurrent form.
        segments: (b, n) long run index of packed sequences, or None.
        group: a ``ContextParallel`` when x is one rank's slice, or None.
        rotary: (cos, sin) of x's positions for rotary embeddings, or None.
        tensor: given a cache, its position (a long tensor of no dimension), else None.
        row_starts: (b,) long, each row's first real column (rows padded on the left), or None.
    """

    position: Optional[int] = 0
    cached: bool = False
    step: bool = False
    segments: Optional[torch.Tensor] = None
    group: Optional[ContextParallel] = None
    rotary: Optional[tuple] = None
    tensor: Optional[torch.Tensor] = None
    row_starts: Optional[torch.Tensor] = None
    # the position of x's first token in its sequence: an int, or on a step the tensor
    start: object = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        start = self.group.start if self.group is not None else \
            self.tensor if self.position is None else self.position
        object.__setattr__(self, "start", start)

    @classmethod
    def of(cls, x, cache=None, return_cache=False, segment_ids=None, context_parallel=None,
           check: Optional[Callable[["Place", int, bool], None]] = None, input_mask=None) -> "Place":
        """The place of x (b, n, …) given a forward's arguments (``cache``: the one x continues;
        ``return_cache``: the forward returns one; ``input_mask``: x's, checked by the caller,
        for ``row_starts``), checked as the module docstring says: the layer's ``check(place,
        n, parallel)`` runs before the group communicates."""
        cached = cache is not None or return_cache
        if segment_ids is not None or context_parallel is not None:
            check_segment_ids(segment_ids, x.shape[:2])
            check_modes(segment_ids is not None, cached, context_parallel is not None)
        if cache is not None:
            tensor = cache.position
            step = x.shape[1] == 1 and not torch.is_grad_enabled() and (input_mask is None or _all_real(input_mask))
            free = tensor.device.type == "cpu" and not torch.compiler.is_compiling()  # (a read without a wait)
            row_starts = getattr(cache, "row_starts", None)
            if row_starts is not None and input_mask is not None:
                row_starts = continued_row_starts(row_starts, tensor, input_mask)
            place = cls(int(tensor) if free or not step else None, True, step, tensor=tensor, row_starts=row_starts)
        elif segment_ids is None and context_parallel is None:
            place = cls(0, cached, row_starts=None if input_mask is None else left_padding(input_mask))
        else:  # (packed rows count positions per segment; a slice cannot see where its row starts)
            place = cls(0, cached, segments=None if segment_ids is None else segment_runs(segment_ids))
        if check is not None:
            check(place, x.shape[1], context_parallel is not None)
        if context_parallel is None:
            return place
        return place.but(group=ContextParallel.of(context_parallel, x.shape[0], x.shape[1], x.device))

    def positions(self, n, device=None) -> torch.Tensor:
        """x's positions: (n,) from ``start``, or (b, n) inside each packed segment or from
        each row's first real column (padding before it at 0)."""
        if self.segments is not None:
            return positions_in_segment(self.segments)
        columns = torch.arange(n, device=device) + self.start
        if self.row_starts is None:
            return columns
        return (columns - self.row_starts[:, None]).clamp(min=0)

    def row_runs(self, n, device=None) -> Optional[torch.Tensor]:
        """(b, n) long: 0 on a row's padding before its first real column, 1 from there on
        (segments that align each row's windows and blocks to its own start), or None."""
        if self.row_starts is None:
            return None
        return (torch.arange(n, device=device) + self.start >= self.row_starts[:, None]).long()

    def but(self, **changes) -> "Place":
        return dataclasses.replace(self, **changes)


PLAIN = Place()


def _all_real(input_mask):
    """Whether no token of ``input_mask`` is padding (one value read back; inside
    ``torch.compile`` only an absent mask counts)."""
    if input_mask is None:
        return True
    return not torch.compiler.is_compiling() and torch.is_tensor(input_mask) and input_mask.dtype == torch.bool \
        and bool(input_mask.all())


def continued_row_starts(row_starts, position, input_mask):
    """A cache's ``row_starts`` after a call that continues it at column ``position``: a row
    that has had no real token yet (its start still ``position``) starts at this call's
    first real token (or after it)."""
    if row_starts is None or input_mask is None:
        return row_starts
    return torch.where(row_starts == position, position + first_real_columns(input_mask), row_starts)


def left_padding(input_mask):
    """Each row's first real column (b,) long when some row of ``input_mask`` (b, n) starts
    with padding, else None (one value read back; none inside ``torch.compile``, where the
    columns are always counted per row). A row without a real token starts after the last
    column."""
    if input_mask is None:
        return None
    starts = first_real_columns(input_mask)
    if not torch.compiler.is_compiling() and not bool(starts.any()):
        return None
    return starts


def first_real_columns(input_mask):
    """(b,) long: each row's first True column of ``input_mask`` (b, n), n for a row without one."""
    return torch.where(input_mask.any(dim=1), input_mask.int().argmax(dim=1), input_mask.shape[1])


def check_modes(packed=False, cached=False, parallel=False):
    """Raise ValueError when the modes asked for exclude each other."""
    if packed and cached:
        raise ValueError("segment_ids cannot be combined with a cache (cache / return_cache): "
                         "a cache continues one sequence; decode each segment on its own")
    for refused, what in ((packed, "packed sequences (segment_ids): one sequence is split over the ranks"),
                          (cached, "a cache (cache / return_cache): decoding continues one sequence on one rank")):
        if parallel and refused:
            raise ValueError(f"context_parallel is not supported with {what} yet")
