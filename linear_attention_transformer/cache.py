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


class _Cache:
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
    if isinstance(obj, (_Cache, CausalState, Position)):
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
    elif isinstance(into, (_Cache, CausalState)):
        for name in getattr(into, "fields", into.__slots__):
            field = getattr(into, name)
            if isinstance(field, int):  # (a position: the part's count is the one after the call)
                setattr(into, name, getattr(part, name))
            else:
                copy_rows(field, rows, getattr(part, name))


class LocalCache(_Cache):
    """Local heads: a ring of ``slots`` (``Window.most_keys``) keys and values, kv (b, 2, h, slots,
    d) (position t in slot t mod slots), and each slot's key position per row, positions
    (b, slots) (``NO_KEY``: no real key)."""

    __slots__ = ("kv", "positions")

    @classmethod
    def zeros(cls, batch, heads, slots, dim_head, device=None, dtype=torch.float32):
        kv = torch.zeros(batch, 2, heads, slots, dim_head, device=device, dtype=dtype)
        return cls(kv, torch.full((batch, slots), NO_KEY, dtype=torch.long, device=device))

    @property
    def slots(self):
        return self.positions.shape[1]

    @property
    def keys(self):
        """(b, h, slots, d), a view of ``kv``."""
        return self.kv[:, 0]

    @torch.no_grad()
    def write(self, k, v, start, mask=None, row_starts=None):
        """Keys and values k, v (b, h, n, d) of columns start .. start + n - 1 (``mask``
        (b, n): False where a token is padding) go to their slots; only the last ``slots``.
        A key's position is its column, less its row's first real column (``row_starts``
        (b,), left padding) when given."""
        n, slots = k.shape[2], self.slots
        keep = min(n, slots)
        at = torch.arange(start + n - keep, start + n, device=k.device)
        where = at % slots
        self.kv[:, 0].index_copy_(2, where, k[:, :, n - keep:].to(self.kv.dtype))
        self.kv[:, 1].index_copy_(2, where, v[:, :, n - keep:].to(self.kv.dtype))
        positions = at.expand(k.shape[0], keep) if row_starts is None else at - row_starts[:, None]
        if mask is not None:
            positions = torch.where(mask[:, n - keep:], positions, NO_KEY)
        self.positions.index_copy_(1, where, positions)


class GlobalCache(_Cache):
    """Global heads: their ``CausalState`` (running KᵀV, normaliser, references, blindspot
    block) and the local convolution's last inputs of q, k and v, conv: one (b, 3, h, kernel -
    1, d) tensor, or with q and k of another width than v (``dim_qk``) two, (b, 2, h, kernel -
    1, dim_qk) and (b, 1, h, kernel - 1, dim_head) (``Attention.conv_groups``); or None."""

    __slots__ = ("state", "conv")


class AttentionCache(_Cache):
    """One attention layer: ``local`` (LocalCache or None), ``global_`` (GlobalCache or None),
    for a cross-attention layer ``context`` (the encoder's keys and values reduced once to
    kᵀv), and ``position``: the tokens the layer's own forward has consumed (None inside a
    model, whose ``DecodingCache`` counts for every layer)."""

    __slots__ = ("position", "local", "global_", "context")


class AxialCache(_Cache):
    """Axial attention: one ``AttentionCache`` over a batch of b * w rows, row (i, r) holding
    the sequence of positions t = r mod w of batch element i."""

    __slots__ = ("inner",)


class BranchCache(_Cache):
    """A residual branch: the previous token's normalised features for token shifting
    (b, dim) or None, and the cache of the branch's module or None."""

    __slots__ = ("shift", "fn")


class Position:
    """Tokens consumed: the one count a ``DecodingCache`` keeps and every layer reads. An int on
    the host; the one-token step also keeps it as a long tensor of no dimension on the model's
    device (``tensor``), advanced in place by steps that read nothing back: the int is then read
    back once, when asked for."""

    __slots__ = ("_host", "tensor")

    def __init__(self, count=0, tensor=None):
        self._host, self.tensor = count, tensor

    def __int__(self):
        if self._host is None:
            self._host = int(self.tensor)
        return self._host

    def on(self, device):
        """The count as a tensor on ``device`` (made once)."""
        if self.tensor is None:
            self.tensor = torch.tensor(int(self), dtype=torch.long, device=device)
        return self.tensor

    def set(self, count):
        self._host = count
        if self.tensor is not None:
            self.tensor.fill_(count)

    def advance(self):
        """One token more: on the device, and on the host unless the host's count is unknown
        (traced steps leave it to be read back)."""
        if self.tensor is not None:
            self.tensor.add_(1)
        if torch.compiler.is_compiling():  # (not read: a compiled step would guard on the int)
            self._host = None
        elif self._host is not None:
            self._host += 1

    def map_tensors(self, fn):
        """A position of ``fn`` applied to its tensor (the host's count kept)."""
        return Position(int(self), None if self.tensor is None else fn(self.tensor))


class DecodingCache(_Cache):
    """The whole model after ``position`` tokens (an int; its one count, ``counter``, a
    ``Position``): ``layers`` holds a (BranchCache, BranchCache) pair per residual block, in
    order; ``row_starts`` (b,) long, each row's first real column when the first call's rows
    were padded on the left (positions count from there), else None; ``steps``: what a model's
    one-token forward reads besides the buffers, made once per cache by the model (None until
    then; a copy of the cache, ``map_tensors``, makes its own)."""

    __slots__ = ("counter", "layers", "row_starts", "steps")

    def __init__(self, counter, layers, row_starts=None, steps=None):
        super().__init__(counter, layers, row_starts, steps)

    def map_tensors(self, fn):
        return DecodingCache(map_tensors(self.counter, fn), map_tensors(self.layers, fn), map_tensors(self.row_starts, fn))

    def static_tensors(self):
        """Every tensor a one-token step reads or writes other than the model's parameters: the
        buffers (their shapes never change) and what ``steps`` made (a CUDA graph's inputs,
        to mark with ``torch._dynamo.mark_static_address`` before compiling)."""
        return tensors_of(self) + ([] if self.steps is None else self.steps.tensors())

    @property
    def position(self):
        return int(self.counter)

    @position.setter
    def position(self, count):
        self.counter.set(count)
