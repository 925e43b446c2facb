"""What cached decoding keeps between calls, layer by layer.

Causal linear attention is a recurrence, so a decoder needs only a fixed-size state per
layer to continue a sequence: the running KᵀV of the global heads, the last keys of the local
heads' window, the last inputs of the local convolution, the previous token for token
shifting. ``LinearAttentionTransformerLM.forward(x, cache=..., return_cache=True)`` returns a
``DecodingCache``; give it back with the next tokens.

Caches are never modified in place: every call returns a new one, so a caller can keep an old
cache and branch from it (beam search, several samples from one prompt). ``cache.to(device)``
moves one. All classes here hold tensors whose first dimension is the batch.
"""

from __future__ import annotations

import torch

from .ops import CausalState


def map_tensors(obj, fn):
    """Rebuild a cache with ``fn`` applied to every tensor in it."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, (CausalState, LocalCache, GlobalCache, AttentionCache, BranchCache, DecodingCache, AxialCache)):
        return type(obj)(*(map_tensors(getattr(obj, name), fn) for name in obj.__slots__))
    return obj


def zip_tensors(a, b, fn):
    """Rebuild cache ``a`` with fn(tensor of a, matching tensor of b) (same structure)."""
    if torch.is_tensor(a):
        return fn(a, b)
    if isinstance(a, (tuple, list)):
        return type(a)(zip_tensors(x, y, fn) for x, y in zip(a, b))
    if isinstance(a, (CausalState, LocalCache, GlobalCache, AttentionCache, BranchCache, DecodingCache, AxialCache)):
        return type(a)(*(zip_tensors(getattr(a, n), getattr(b, n), fn) for n in a.__slots__))
    return b


class _Cache:
    __slots__ = ()

    def to(self, *args, **kwargs):
        """Like ``nn.Module.to``: a device moves every tensor, a dtype converts the floating ones
        (masks stay bool)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)

        def move(t):
            return t.to(device, dtype if t.is_floating_point() else None, non_blocking=non_blocking)

        return map_tensors(self, move)

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n).__class__.__name__}" for n in self.__slots__)
        return f"{self.__class__.__name__}({fields})"


class LocalCache(_Cache):
    """Local heads: keys/values (b, h, m, d) at absolute positions start .. start + m - 1 with
    their padding mask (b, m); only the keys a later query's window can still reach."""

    __slots__ = ("keys", "values", "mask", "start")

    def __init__(self, keys, values, mask, start):
        self.keys, self.values, self.mask, self.start = keys, values, mask, start

    def keep_from(self, position):
        """Drop keys before ``position``: no later query can see them."""
        cut = max(0, position - self.start)
        return LocalCache(self.keys[:, :, cut:], self.values[:, :, cut:], self.mask[:, cut:], self.start + cut)


class GlobalCache(_Cache):
    """Global heads: their ``CausalState`` (running KᵀV, normaliser, references, blindspot block)
    and the local convolution's last inputs (q, k, v), each (b, h, kernel - 1, d), or None."""

    __slots__ = ("state", "conv")

    def __init__(self, state, conv):
        self.state, self.conv = state, conv


class AttentionCache(_Cache):
    """One attention layer: tokens consumed (``position``), ``local`` (LocalCache or None),
    ``global_`` (GlobalCache or None), and for a cross-attention layer ``context``: the
    encoder's keys and values reduced once to kᵀv."""

    __slots__ = ("position", "local", "global_", "context")

    def __init__(self, position, local, global_, context):
        self.position, self.local, self.global_, self.context = position, local, global_, context


class AxialCache(_Cache):
    """Axial attention: one ``AttentionCache`` over a batch of b * w rows, row (i, r) holding
    the sequence of positions t = r mod w of batch element i; ``position``: tokens consumed."""

    __slots__ = ("inner", "position")

    def __init__(self, inner, position):
        self.inner, self.position = inner, position


class BranchCache(_Cache):
    """A residual branch: the previous token's normalised features for token shifting
    (b, dim) or None, and the cache of the branch's module or None."""

    __slots__ = ("shift", "fn")

    def __init__(self, shift, fn):
        self.shift, self.fn = shift, fn


class DecodingCache(_Cache):
    """The whole model after ``position`` tokens: ``layers`` holds a (BranchCache, BranchCache)
    pair per residual block, in order."""

    __slots__ = ("position", "layers")

    def __init__(self, position, layers):
        self.position, self.layers = position, layers
