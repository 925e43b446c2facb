"""What cached decoding keeps between calls, layer by layer: fixed-shape buffers, updated in place.

``model(x, return_cache=True)`` returns a ``DecodingCache``; how it is used, branched
(``clone()``) and moved: docs/training.md, "The cache". Every tensor here has the batch as its
first dimension.
"""

from __future__ import annotations

import torch

from .ops.causal.recurrent import CausalState

# the position of a ring slot that holds no key (before the prompt, or its padding): below
# the first key of every window
NO_KEY = -(2 ** 62)


class CacheRecord:
    """A record of buffers: its fields are its ``__slots__``, given in that order."""

    __slots__ = ()

    def __init__(self, *fields):
        for name, value in zip(self.__slots__, fields):
            setattr(self, name, value)

    def map_tensors(self, fn):
        """A cache of ``fn`` applied to each of this one's tensors."""
        return type(self)(*(map_tensors(getattr(self, name), fn) for name in self.__slots__))

    def clone(self):
        """A copy with buffers of its own: stepping one leaves the other as it was."""
        return map_tensors(self, torch.clone)

    def to(self, *args, **kwargs):
        """Like ``nn.Module.to``, but a copy (buffers of its own, as ``clone``): a device moves
        every tensor, a dtype converts the floating ones (positions keep theirs)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        return map_tensors(self, lambda t: t.to(device, dtype if t.is_floating_point() else None,
                                                non_blocking=non_blocking, copy=True))

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n).__class__.__name__}" for n in self.__slots__)
        return f"{self.__class__.__name__}({fields})"


def map_tensors(obj, fn):
    """A cache rebuilt with ``fn`` applied to every tensor in it."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, (CacheRecord, CausalState)):
        return obj.map_tensors(fn)
    return obj


def for_call(cache, return_cache):
    """The cache a call continues from and updates in place: ``cache`` itself when the call
    returns it, else a copy (a call that only reads a cache leaves it as it was)."""
    return cache if return_cache or cache is None else cache.clone()


def tensors_of(obj):
    """Every tensor of a cache, in order."""
    found = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


def copy_rows(into, rows, part):
    """Write cache ``part`` (the batch rows ``rows`` of ``into``, same structure) back into
    ``into`` in place."""
    if torch.is_tensor(into):
        into.index_copy_(0, rows, part.to(into.dtype))
    elif isinstance(into, (tuple, list)):
        for a, b in zip(into, part):
            copy_rows(a, rows, b)
    elif isinstance(into, (CacheRecord, CausalState)):
        for name in getattr(into, "fields", into.__slots__):
            field = getattr(into, name)
            if torch.is_tensor(field) and field.ndim == 0:  # (a count has no rows)
                field.copy_(getattr(part, name))
            else:
                copy_rows(field, rows, getattr(part, name))


class LocalCache(CacheRecord):
    """Local heads: a ring of ``slots`` (``Window.most_keys``) keys and values, kv (b, 2, h, slots,
    d), and each slot's key position per row, positions (b, slots) (``NO_KEY``: no real key). A
    row's key of position t (counted from the row's first real column) is in slot t mod slots,
    so a row's ring is laid out alike whatever column its sequence started at."""

    __slots__ = ("kv", "positions")

    @classmethod
    def zeros(cls, batch, heads, slots, dim_head, device=None, dtype=torch.float32):
        kv = torch.zeros(batch, 2, heads, slots, dim_head, device=device, dtype=dtype)
        return cls(kv, torch.full((batch, slots), NO_KEY, dtype=torch.long, device=device))

    @property
    def keys(self):
        """(b, h, slots, d), a view of ``kv``."""
        return self.kv[:, 0]

    @torch.no_grad()
    def write(self, k, v, start, mask=None, row_starts=None):
        """Keys and values k, v (b, h, n, d) of columns start .. start + n - 1 (``start`` an int
        or a long tensor of no dimension; ``mask`` (b, n): False where a token is padding) go
        to their slots; only the last ``slots``. A key's position is its column, less its row's
        first real column (``row_starts`` (b,), left padding) when given."""
        n, slots = k.shape[2], self.positions.shape[1]
        if n == 1 and mask is None and isinstance(start, int) and row_starts is None:  # (a known slot: views)
            slot = start % slots
            self.kv[:, 0, :, slot].copy_(k[:, :, 0])
            self.kv[:, 1, :, slot].copy_(v[:, :, 0])
            self.positions[:, slot] = start
            return
        if n == 1 and mask is None and row_starts is None:  # (the position a tensor: one select per buffer,
            # no scatter, which runs slower in an exported graph)
            hit = torch.arange(slots, device=k.device) == torch.remainder(start, slots)
            new = torch.stack((k, v), dim=1).to(self.kv.dtype)  # (b, 2, h, 1, d)
            self.kv.copy_(torch.where(hit[:, None], new, self.kv))
            self.positions.copy_(torch.where(hit, start, self.positions))
            return
        keep = min(n, slots)
        at = torch.arange(n - keep, n, device=k.device) + start
        # (b, keep): each row's key positions, in distinct slots of the row
        positions = at.expand(k.shape[0], keep) if row_starts is None else at - row_starts[:, None]
        where = positions % slots
        index = where[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        for i, new in enumerate((k, v)):
            self.kv[:, i].scatter_(2, index, new[:, :, n - keep:].to(self.kv.dtype))
        if mask is not None:
            positions = torch.where(mask[:, n - keep:], positions, NO_KEY)
        self.positions.scatter_(1, where, positions)


class AttentionCache(CacheRecord):
    """One attention layer: ``local`` (LocalCache or None), ``global_`` (the global heads' entry,
    ``heads.AdditiveCache`` or ``heads.DeltaCache``, or None),
    for a cross-attention layer ``context`` (the encoder's keys and values reduced once to
    kᵀv), and ``position``: the tokens the layer's own forward has consumed, a long tensor of
    no dimension (None inside a model, whose ``DecodingCache`` counts for every layer)."""

    __slots__ = ("position", "local", "global_", "context")


class AxialCache(CacheRecord):
    """Axial attention: one ``AttentionCache`` over a batch of b * w rows, row (i, r) holding
    the sequence of positions t = r mod w of batch element i."""

    __slots__ = ("inner",)


class BranchCache(CacheRecord):
    """A residual branch: the previous token's normalised features for token shifting
    (b, dim) or None, and the cache of the branch's module or None."""

    __slots__ = ("shift", "fn")


class DecodingCache(CacheRecord):
    """The whole model after ``position`` tokens: ``position`` is the count, a long tensor of no
    dimension on the model's device (the one count every layer reads, advanced in place);
    ``layers`` holds a (BranchCache, BranchCache) pair per residual block, in order;
    ``row_starts`` (b,) long, each row's first real column when the first call's rows were
    padded on the left (positions count from there), else None."""

    __slots__ = ("position", "layers", "row_starts")

    def __init__(self, position, layers, row_starts=None):
        super().__init__(position, layers, row_starts)

    def rows(self):
        """The batch size: the rows of the first buffer that has them (None: no such buffer)."""
        pending = [self.layers]
        while pending:  # (depth first, in order)
            obj = pending.pop()
            if torch.is_tensor(obj):
                if obj.ndim:
                    return obj.shape[0]
            elif isinstance(obj, (tuple, list)):
                pending.extend(reversed(obj))
            elif isinstance(obj, (CacheRecord, CausalState)):
                for name in reversed(obj.__slots__):
                    pending.append(getattr(obj, name))
        return None

    def static_tensors(self):
        """Every tensor a one-token forward reads or writes other than the model's parameters:
        the buffers, whose shapes never change (a CUDA graph's inputs, to mark with
        ``torch._dynamo.mark_static_address`` before compiling)."""
        return tensors_of(self)
