"""Where a sequence sits: one object, made once per forward and read by every layer.

A forward runs x (b, n, …) in one of four modes:

* plain: x is a whole sequence, its first token at position 0;
* cached: x continues a sequence after ``position`` earlier tokens, and every layer reads and
  updates its cache (``cache.py``);
* packed: x holds several sequences per row, ``segments`` (``ops/segments.py``);
* context parallel: x is one rank's slice of a sequence split over ``group``
  (``context_parallel.py``), its first token at ``group.start``.

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
        position: the tokens before x in its sequence (a cache's position; 0 without one); on a
            decoder's step that does not know it on the host (a traced step), None.
        cached: whether the layers continue from their caches and update them.
        segments: (b, n) long run index of packed sequences, or None.
        group: a ``ContextParallel`` when x is one rank's slice, or None.
        rotary: (cos, sin) of x's positions for rotary embeddings, or None.
        tensor: on a decoder's step, the position as a long tensor of no dimension on the
            model's device (the cache's ``Position``), else None.
    """

    position: Optional[int] = 0
    cached: bool = False
    segments: Optional[torch.Tensor] = None
    group: Optional[ContextParallel] = None
    rotary: Optional[tuple] = None
    tensor: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, x, cache=None, return_cache=False, segment_ids=None, context_parallel=None,
           check: Optional[Callable[["Place", int, bool], None]] = None) -> "Place":
        """The place of x (b, n, …) given a forward's arguments (``cache``: the one x continues;
        ``return_cache``: the forward returns one), checked as the module docstring says: the
        layer's ``check(place, n, parallel)`` runs before the group communicates."""
        cached = cache is not None or return_cache
        check_segment_ids(segment_ids, x.shape[:2])
        check_modes(segment_ids is not None, cached, context_parallel is not None)
        place = cls(0 if cache is None else cache.position, cached,
                    None if segment_ids is None else segment_runs(segment_ids))
        if check is not None:
            check(place, x.shape[1], context_parallel is not None)
        if context_parallel is None:
            return place
        return place.but(group=ContextParallel.of(context_parallel, x.shape[0], x.shape[1], x.device))

    @property
    def start(self) -> int:
        """The position of x's first token in its sequence."""
        return self.group.start if self.group is not None else self.position

    def positions(self, n, device=None) -> torch.Tensor:
        """x's positions: (n,) from ``start``, or (b, n) inside each packed segment."""
        if self.segments is not None:
            return positions_in_segment(self.segments)
        return torch.arange(self.start, self.start + n, device=device)

    def but(self, **changes) -> "Place":
        return dataclasses.replace(self, **changes)


PLAIN = Place()


def check_modes(packed=False, cached=False, parallel=False):
    """Raise ValueError when the modes asked for exclude each other."""
    if packed and cached:
        raise ValueError("segment_ids cannot be combined with a cache (cache / return_cache): "
                         "a cache continues one sequence; decode each segment on its own")
    for refused, what in ((packed, "packed sequences (segment_ids): one sequence is split over the ranks"),
                          (cached, "a cache (cache / return_cache): decoding continues one sequence on one rank")):
        if parallel and refused:
            raise ValueError(f"context_parallel is not supported with {what} yet")
