"""The kinds of head an attention layer mixes, one module each.

``Attention`` projects the queries, keys and values of all its heads at once, then hands each
kind its share: ``forward(q, k, v, x, mask, place, cache)`` -> (b, h, n, e), where x is the
layer's input (what gates are computed from), ``place`` where the tokens sit (``place.py``) and
``cache`` the kind's own entry of the decoding cache (``empty_cache``), updated in place. Each
kind picks its form inside its forward: the one-token recurrence on a ``place.step``, else the
chunked form, continued from the cache unless the sequence starts here.

* ``LocalHeads``: an exact softmax inside a sliding window; its cache a ring of keys and values.
* ``WindowLinearHeads``: the same window (and the first keys, sinks) by softmax, every older key
  by linear attention through learnt features, one normalisation (``ops/window_linear.py``); its
  cache the ring, the sinks and a linear state.
* ``AdditiveHeads``: linear attention, S_t = a_t S_{t-1} + phi(k_t) v_tᵀ read normalised
  (``ops/causal``; without a causal order ``ops/linear_attention.py``).
* ``DeltaHeads``: the delta rule (``ops/delta``), causal only.

``GLOBAL_HEADS`` maps a layer's ``update_rule`` to the class of its global heads: a new rule is
one class here and one entry there. Inputs reach these modules checked: the constructor that
the user called checked the options, and the forward that the call entered checked its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .cache import NO_KEY, CacheRecord, LocalCache
from .context_parallel import (context_parallel_causal_linear_attention, context_parallel_linear_attention,
                               exchange_boundaries)
from .gating import ForgetGate, LocalConv
from .ops import FeatureMap, causal_linear_attention, linear_attention
from .ops.causal.recurrent import CausalState, join_flags
from .ops.common import NEG_INF, compute_dtype
from .ops.delta import chunk_delta_rule, delta_rule_step
from .ops.windowed_attention import windowed_attention, windowed_attention_by_position, windowed_attention_step
from .ops.window_linear import (window_linear_attention, window_linear_attention_by_position,
                                window_linear_attention_step)
from .ops.windowed_flex import flex_windowed_attention, local_implementation


class LocalHeads(nn.Module):
    """Windowed softmax heads (``ops/windowed_attention.py``); positions come from the model.

    Args: heads; window: the ``Window``; kernel: which implementation may run (``whole_sequence``).
    No parameters: the layer projects their q, k and v."""

    def __init__(self, heads, window, kernel="auto"):
        super().__init__()
        self.heads, self.window, self.kernel = heads, window, kernel

    def empty_cache(self, batch_size, dim_head, device=None, dtype=torch.float32):
        return LocalCache.zeros(batch_size, self.heads, self.window.most_keys, dim_head, device, dtype)

    def forward(self, q, k, v, x, mask, place, cache=None):
        if place.step:  # one query per row over the ring (``LocalCache``)
            start, row_starts = place.start, place.row_starts
            # its own key and value enter their slot first: the key they replace is older than its window
            cache.write(k, v, start, None, row_starts)
            p = start if row_starts is None else (start - row_starts)[:, None]
            hidden = cache.positions < self.window.first_key(p)  # (an empty slot's NO_KEY lies below every window)
            bias = torch.zeros(hidden.shape, dtype=cache.kv.dtype, device=hidden.device).masked_fill_(hidden, NEG_INF)
            keys, values = cache.kv.unbind(1)
            return windowed_attention_step(q * q.shape[-1] ** -0.5, keys, values, bias[:, None])[:, :, None]
        if place.group is not None:
            return self._context_parallel(q, k, v, mask, place.group)
        if cache is None or place.position == 0:
            # (rows padded on the left: each row's windows start at its first real token)
            runs = place.segments if place.segments is not None else place.row_runs(q.shape[2], q.device)
            out = self.whole_sequence(q, k, v, mask, runs)
        else:
            out = self._continued(q, k, v, mask, cache, place.position, place.row_starts)
        if cache is not None:
            cache.write(k, v, place.position, mask, place.row_starts)
        return out

    def check_slice(self, length):
        """ValueError unless one rank's slice of ``length`` tokens can run under context parallelism."""
        window = self.window
        if length % window.size:
            raise ValueError(f"context_parallel with local heads needs slices of a multiple of "
                             f"local_attn_window_size={window.size} tokens, got {length}")
        if length < max(window.look_backward, window.look_forward) * window.size:
            raise ValueError(f"context_parallel with local heads needs slices of at least local_attn_look_backward "
                             f"(and local_attn_look_forward) * local_attn_window_size tokens, got {length}")

    def whole_sequence(self, q, k, v, mask, segments=None):
        """Over a whole sequence; flex_attention on CUDA (docs/kernels.md)."""
        if local_implementation(q.device, q.dtype, self.kernel, q.shape[-1]) == "flex":
            return flex_windowed_attention(q, k, v, self.window, mask, segments)
        return windowed_attention(q, k, v, self.window, mask, segments)

    def _continued(self, q, k, v, mask, cache, position, row_starts=None):
        """The new queries over the ring's keys and their own (before they are written);
        positions count from each row's first real column when ``row_starts`` (b,) is given."""
        n = q.shape[2]
        keys, values = (torch.cat((stored, new.to(stored.dtype)), dim=2) for stored, new in zip(cache.kv.unbind(1), (k, v)))
        q_positions = torch.arange(position, position + n, device=q.device)
        if row_starts is not None:
            q_positions = q_positions - row_starts[:, None]
        new_positions = q_positions.expand(q.shape[0], n) if mask is None else torch.where(mask, q_positions, NO_KEY)
        k_positions = torch.cat((cache.positions, new_positions), dim=1)  # NO_KEY: before every window
        return windowed_attention_by_position(q, keys, values, q_positions, k_positions, self.window)

    def _context_parallel(self, q, k, v, mask, group):
        """Across the slice's ends: the neighbours' boundary windows of keys and values
        (look_backward * w before, look_forward * w after) extend the slice; the queries are
        padded alike and their outputs cut back (the slice is a multiple of w long)."""
        window = self.window
        before, after = window.look_backward * window.size, window.look_forward * window.size
        mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if mask is None else mask
        (kb, ka), (vb, va), (mb, ma) = exchange_boundaries([(k, 2), (v, 2), (mask, 1)], group, before, after)
        n = q.shape[2]
        q = F.pad(q, (0, 0, before, after))
        k, v = torch.cat((kb, k, ka), dim=2), torch.cat((vb, v, va), dim=2)
        out = windowed_attention(q, k, v, window, torch.cat((mb, mask, ma), dim=1))
        return out[:, :, before : before + n]


class HedgehogFeatures(nn.Module):
    """Hedgehog's learnt feature map, per head: f(x) = [softmax(x W_h + b_h), softmax(-(x W_h +
    b_h))] over its ``features``, so f(q)·f(k) >= 0. W starts as the identity (its first
    min(d, features) columns), b at 0. x (b, h, n, d) -> (b, h, n, 2 features), in at least
    float32."""

    def __init__(self, heads, dim_head, features):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(dim_head, features).repeat(heads, 1, 1))  # (h, d, features)
        self.bias = nn.Parameter(torch.zeros(heads, features))

    def forward(self, x):
        projected = torch.einsum("bhnd,hdf->bhnf", x.to(compute_dtype(x)), self.weight) + self.bias[:, None]
        return torch.cat((projected.softmax(dim=-1), (-projected).softmax(dim=-1)), dim=-1)


# the starting log weight of a window + linear head's older keys: a linearized model starts close
# to its window and sinks alone, and learns how much the older keys weigh
OLDER_LOG_WEIGHT = -3.0


class WindowLinearCache(CacheRecord):
    """The cache entry of ``WindowLinearHeads``: ``ring``, the last W keys and values, and
    ``sinks``, the sequence's first S (``LocalCache`` both; sinks None when S is 0); the state
    of every other older key, kv (b, h, 2 features, d) and z (b, h, 2 features), in at least
    float32."""

    __slots__ = ("ring", "sinks", "kv", "z")


class WindowLinearHeads(nn.Module):
    """Softmax over the last W keys and the sequence's first S, and linear attention through
    learnt features (``HedgehogFeatures``, one map for queries, one for keys) over every other
    older key, one normalisation (``ops/window_linear.py``): what ``convert.linearize`` makes of
    a pretrained softmax head.

    Args: heads; window: the ``Window`` (causal and exact: W = look_backward * size keys);
    dim_head; features: each feature map's size (a head reads 2 features); sinks: S. Causal
    only; not with packed sequences or context parallelism."""

    def __init__(self, heads, window, dim_head, features, sinks=0):
        super().__init__()
        self.heads, self.window, self.keys, self.sinks = heads, window, window.most_keys, sinks
        self.query_features = HedgehogFeatures(heads, dim_head, features)
        self.key_features = HedgehogFeatures(heads, dim_head, features)
        # each head's weight on its older keys, exp of this, at first small beside the window's
        self.older_log_weight = nn.Parameter(torch.full((heads,), OLDER_LOG_WEIGHT))

    def empty_cache(self, batch_size, dim_head, device=None, dtype=torch.float32):
        state_dtype = torch.promote_types(dtype, torch.float32)
        width = 2 * self.key_features.bias.shape[-1]
        sinks = LocalCache.zeros(batch_size, self.heads, self.sinks, dim_head, device, dtype) if self.sinks else None
        return WindowLinearCache(LocalCache.zeros(batch_size, self.heads, self.keys, dim_head, device, dtype), sinks,
                                 torch.zeros(batch_size, self.heads, width, dim_head, device=device, dtype=state_dtype),
                                 torch.zeros(batch_size, self.heads, width, device=device, dtype=state_dtype))

    def check_slice(self, length):
        raise ValueError("context_parallel is not supported with local_attn_older_keys='linear': run the sequence "
                         "on one process")

    def forward(self, q, k, v, x, mask, place, cache=None):
        fq = self.query_features(q) * self.older_log_weight.exp()[:, None, None].to(compute_dtype(q))
        if place.step:
            return self._step(q, k, v, fq, place, cache)
        fk = self.key_features(k)
        if cache is None:
            return window_linear_attention(q, k, v, fq, fk, self.keys, mask, self.sinks, place.row_starts)
        n = q.shape[2]
        # each token's position in its row (counted from the row's first real column); a key's NO_KEY where masked
        at = place.positions(n, q.device).expand(q.shape[0], n)
        positions = at if mask is None else torch.where(mask, at, NO_KEY)
        if place.position == 0:
            out = window_linear_attention(q, k, v, fq, fk, self.keys, mask, self.sinks, place.row_starts)
            # the keys before the ring's, sinks aside, into the state
            self._fold(cache, fk, v, (torch.arange(n, device=q.device) < n - self.keys) & (positions >= self.sinks))
        else:
            out = self._continued(q, k, v, fq, fk, at, positions, cache)
        cache.ring.write(k, v, place.position, mask, place.row_starts)
        self._write_sinks(cache, k, v, positions)
        return out

    def _step(self, q, k, v, fq, place, cache):
        """One token: the key leaving the window joins the state (a sink stays a sink), the new
        one takes its slot in the ring (and among the sinks, if it is one)."""
        ring, start, row_starts = cache.ring, place.start, place.row_starts
        p = torch.as_tensor(start if row_starts is None else start - row_starts, device=q.device).reshape(-1, 1)
        rows = ring.positions.shape[0]
        slot = torch.remainder(p, self.keys).expand(rows, 1)
        leaving = ring.positions.gather(1, slot) >= self.sinks  # (b, 1)
        index = slot[:, None, :, None].expand(-1, self.heads, -1, q.shape[-1])
        old_k, old_v = (ring.kv[:, i].gather(2, index) for i in (0, 1))  # (b, h, 1, d)
        self._fold(cache, self.key_features(old_k), old_v, leaving)
        ring.write(k, v, start, None, row_starts)
        keys, values, positions = ring.kv[:, 0], ring.kv[:, 1], ring.positions
        hidden = (positions < self.window.first_key(p)) | (positions < self.sinks)  # (sinks: seen as sinks)
        if self.sinks:
            self._write_sinks(cache, k, v, p.expand(rows, 1))
            sinks = cache.sinks
            keys, values = torch.cat((sinks.kv[:, 0], keys), dim=2), torch.cat((sinks.kv[:, 1], values), dim=2)
            hidden = torch.cat((sinks.positions < 0, hidden), dim=1)
        dtype = cache.kv.dtype
        bias = torch.zeros(hidden.shape, dtype=dtype, device=q.device).masked_fill_(hidden, NEG_INF)[:, None]
        out = window_linear_attention_step(q[:, :, 0].to(dtype), keys.to(dtype), values.to(dtype), bias,
                                           fq[:, :, 0].to(dtype), cache.kv, cache.z)
        return out[:, :, None].to(v.dtype)

    def _continued(self, q, k, v, fq, fk, at, positions, cache):
        """New queries over the sinks, the ring's keys, their own and the state; the keys that
        leave the window of the last query join the state."""
        ring, sinks = cache.ring, cache.sinks
        stored = [(ring.kv, torch.where(ring.positions < self.sinks, NO_KEY, ring.positions))]  # (sinks: as sinks)
        if sinks is not None:
            stored.insert(0, (sinks.kv, sinks.positions))
        keys = torch.cat([kv[:, 0] for kv, _ in stored] + [k.to(ring.kv.dtype)], dim=2)
        values = torch.cat([kv[:, 1] for kv, _ in stored] + [v.to(ring.kv.dtype)], dim=2)
        k_positions = torch.cat([at for _, at in stored] + [positions], dim=1)
        features = torch.cat([self.key_features(kv[:, 0]) for kv, _ in stored] + [fk], dim=2)
        out = window_linear_attention_by_position(q, keys, values, fq, features, at, k_positions, self.keys,
                                                  (cache.kv, cache.z), self.sinks)
        last = at[:, -1:]
        self._fold(cache, features, values, (k_positions >= self.sinks) & (k_positions <= last - self.keys))
        return out

    @torch.no_grad()
    def _write_sinks(self, cache, k, v, positions):
        """The keys and values at positions (b, n) below S into their sink slots."""
        if not self.sinks:
            return
        sinks = cache.sinks
        slots = torch.arange(self.sinks, device=k.device)
        hit = positions[:, :, None] == slots  # (b, n, S)
        written = hit.any(dim=1)  # (b, S)
        hit = hit.to(sinks.kv.dtype)
        for i, new in enumerate((k, v)):
            sinks.kv[:, i].copy_(torch.where(written[:, None, :, None],
                                             torch.einsum("bns,bhnd->bhsd", hit, new.to(sinks.kv.dtype)), sinks.kv[:, i]))
        sinks.positions.copy_(torch.where(written, slots, sinks.positions))

    @staticmethod
    @torch.no_grad()
    def _fold(cache, fk, v, keep):
        """Add the keys ``keep`` (b, n) or (n,) marks, features fk (b, h, n, F) and values v,
        to the state."""
        keep = keep.to(cache.kv.dtype)
        keep = keep[None, None, :, None] if keep.ndim == 1 else keep[:, None, :, None]
        fk, v = fk.to(cache.kv.dtype) * keep, v.to(cache.kv.dtype)
        cache.kv.add_(fk.transpose(-1, -2) @ v)
        cache.z.add_(fk.sum(dim=2))


class AdditiveCache(CacheRecord):
    """The cache entry of ``AdditiveHeads``: their ``CausalState`` (running KᵀV, normaliser,
    references, blindspot block; its position None, the model counts) and ``conv``, the local
    convolution's last inputs (``GlobalHeads.empty_conv``) or None."""

    __slots__ = ("state", "conv")


class DeltaCache(CacheRecord):
    """The cache entry of ``DeltaHeads``: S (b, h, dim_qk, dim_head), and ``conv`` as
    ``AdditiveCache``'s."""

    __slots__ = ("kv", "conv")


class GlobalHeads(nn.Module):
    """What every kind of global head shares: a forget gate and a local convolution of q, k, v.

    Args:
        dim: the layer's width (gates read x). heads, dim_qk, dim_head: the heads, the width of
            their queries and keys, and of their values.
        causal: a causal order (a cross-attention layer's heads have none).
        use_gate: a ``ForgetGate`` (its settings in ``gate_settings``).
        use_local_conv: a ``LocalConv`` on each of q, k, v (its settings in ``conv_settings``).
        blindspot_size, chunk_size, kernel: of the causal forms (``ops/causal``, ``ops/delta``).
    """

    # the starting bias of the output gate's channels over these heads (None: PyTorch's default)
    output_gate_bias = None

    def __init__(self, dim, heads, dim_qk, dim_head, causal, use_gate=False, use_local_conv=False, gate_settings=None,
                 conv_settings=None, blindspot_size=1, chunk_size=None, kernel="auto"):
        super().__init__()
        self.heads, self.dim_qk, self.dim_head, self.causal = heads, dim_qk, dim_head, causal
        self.blindspot_size, self.chunk_size, self.kernel = blindspot_size, chunk_size, kernel
        # per head or per feature: one decay per row of the state
        self.forget_gate = ForgetGate(dim, heads, self.key_features(), **(gate_settings or {})) if use_gate else None
        self.local_conv = None
        if use_local_conv:
            self.local_conv = nn.ModuleList([LocalConv(heads * width, causal=causal, **(conv_settings or {}))
                                             for width in (dim_qk, dim_qk, dim_head)])
        # q, k and v of one width share one buffer of the cache (two with dim_qk != dim_head)
        self.conv_groups = ((0, 1, 2),) if dim_qk == dim_head else ((0, 1), (2,))

    def key_features(self):
        """The rows of a head's state."""
        return self.dim_qk

    def check_slice(self, length):
        """ValueError unless one rank's slice of ``length`` tokens can run under context parallelism."""
        if self.causal and length % self.blindspot_size:
            raise ValueError(f"context_parallel needs slices of a multiple of blindspot_size={self.blindspot_size} "
                             f"tokens, got {length}")
        if self.local_conv is not None and length < self.local_conv[0].kernel_size - 1:
            raise ValueError(f"context_parallel needs slices of at least local_conv_kernel - 1 tokens, got {length}")

    def empty_conv(self, batch_size, device, dtype):
        """The convolution's inputs before any token: per group of ``conv_groups``, (b, group,
        h, kernel - 1, width) zeros; None without a convolution."""
        if self.local_conv is None:
            return None
        widths = (self.dim_qk, self.dim_qk, self.dim_head)
        return tuple(torch.zeros(batch_size, len(group), self.heads, self.local_conv[0].kernel_size - 1,
                                 widths[group[0]], device=device, dtype=dtype) for group in self.conv_groups)

    def convolve(self, q, k, v, mask, place, cache):
        """q, k, v through the local convolution, continuing the cache's last inputs (unless the
        sequence starts here) and keeping this call's."""
        if place.group is not None:
            return self._convolve_context_parallel(q, k, v, mask, place.group)
        keep = (None,) * 3 if cache is None else [t for group in cache.conv for t in group.unbind(1)]  # (views)
        previous = keep if place.step or (cache is not None and place.position != 0) else (None,) * 3
        return tuple(conv(t, mask, p, place.segments, kept)
                     for conv, t, p, kept in zip(self.local_conv, (q, k, v), previous, keep))

    def _convolve_context_parallel(self, q, k, v, mask, group):
        """The convolution across the slice's ends: the neighbours' boundary inputs (masked
        ones zeroed) extend the slice, zeros at the sequence's ends as without a split."""
        conv = self.local_conv[0]
        left, right = conv.left_context, conv.kernel_size - 1 - conv.left_context
        if mask is not None:
            q, k, v = (t.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0) for t in (q, k, v))
        halos = exchange_boundaries([(t, 2) for t in (q, k, v)], group, left, right)
        n = q.shape[2]
        return tuple(c(torch.cat((before, t, after), dim=2))[:, :, left : left + n]
                     for c, t, (before, after) in zip(self.local_conv, (q, k, v), halos))


class AdditiveHeads(GlobalHeads):
    """Linear attention, Q(KᵀV) normalised, through a ``feature_map`` (``ops/feature_maps.py``);
    causal: the chunked scan of ``ops/causal`` and its one-token step, with the forget gate's
    decay; otherwise the forget gate weighs each key. Arguments as ``GlobalHeads``'."""

    def __init__(self, dim, heads, dim_qk, dim_head, causal, feature_map=None, **settings):
        self.feature_map = FeatureMap("softmax" if feature_map is None else feature_map)
        super().__init__(dim, heads, dim_qk, dim_head, causal, **settings)

    def key_features(self):
        return self.feature_map.feature_dim(self.dim_qk)

    def empty_cache(self, batch_size, device=None, dtype=torch.float32):
        state_dtype = torch.promote_types(dtype, torch.float32)
        state = CausalState.zeros(batch_size, self.heads, self.key_features(), self.dim_head, self.blindspot_size,
                                  self.feature_map.is_softmax, device, state_dtype)
        state.position = None  # (the model counts the tokens)
        return AdditiveCache(state, self.empty_conv(batch_size, device, dtype))

    def forward(self, q, k, v, x, mask, place, cache=None):
        if self.local_conv is not None:
            q, k, v = self.convolve(q, k, v, mask, place, cache)
        if not self.causal:
            return self._noncausal(q, k, v, x, mask, place)
        log_gate = None if self.forget_gate is None else self.forget_gate(x)
        q, k, exp_features = self.feature_map.causal_features(q, k)
        if place.step:  # one token per row through the state, in place, in its dtype (float32 or wider)
            state = cache.state
            dtype, out_dtype = state.kv.dtype, v.dtype
            q, k, v = q.squeeze(2), k.squeeze(2), v.squeeze(2)
            if q.dtype != dtype:
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            if log_gate is not None:
                log_gate = log_gate.squeeze(2).to(dtype)
            position, blindspot, where = place.start, self.blindspot_size, None
            # a blindspot block joins where it ends: at an int position only then, at a tensor by flags
            if blindspot > 1 and not (isinstance(position, int) and (position + 1) % blindspot):
                zero = state.kv.new_zeros(())
                where = join_flags(position, blindspot, exp_features, zero, zero + NEG_INF)
            # every row has seen a key (read_state then needs no guard) once the first block is
            # behind, where rows start together (left-padded rows count from their own start)
            seen = isinstance(position, int) and place.row_starts is None and position >= (blindspot > 1) * blindspot
            out = state.step(q, k, v, log_gate, where, all_seen=seen).unsqueeze(2)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        if place.group is not None:
            return context_parallel_causal_linear_attention(q, k, v, place.group, log_gate, mask, self.chunk_size,
                                                            exp_features, self.blindspot_size, self.kernel)
        continued = cache is not None and place.position != 0
        out = causal_linear_attention(
            q, k, v, log_gate, mask, blindspot_size=self.blindspot_size, chunk_size=self.chunk_size,
            exp_features=exp_features, state=cache.state.as_causal_state(place.position) if continued else None,
            return_state=cache is not None, segments=place.segments, kernel=self.kernel,
        )
        if cache is None:
            return out
        out, state = out
        with torch.no_grad():
            cache.state.load(state)
        return out

    def _noncausal(self, q, k, v, x, mask, place):
        fm = self.feature_map
        if place.group is not None:  # the softmax map's keys take their softmax over the whole sequence
            key_gates, softmax = self.key_gates(x), fm.is_softmax
            keys = k if softmax else fm.noncausal_keys(k, mask)[0]
            return context_parallel_linear_attention(fm.queries(q), keys, v, place.group, mask, softmax_keys=softmax,
                                                     normalize=not softmax or key_gates is not None,
                                                     key_scale=key_gates)
        k, normalize = self.noncausal_keys(k, mask, x, place.segments)
        return linear_attention(fm.queries(q), k, v, mask, normalize=normalize, segments=place.segments)

    def noncausal_keys(self, k, mask, source, segments=None):
        """Key features without a causal order; with a forget gate its values, computed from
        ``source``, weigh each key (rows then need normalising). Returns (features, normalize)."""
        k, normalize = self.feature_map.noncausal_keys(k, mask, segments)
        key_gates = self.key_gates(source)
        if key_gates is not None:
            k, normalize = k * key_gates.to(k.dtype), True
        return k, normalize

    def key_gates(self, source):
        """The forget gate's factor on each key without a causal order (b, h, n, 1 or d), or None."""
        if self.forget_gate is None:
            return None
        log_gate = self.forget_gate(source)
        return (log_gate if log_gate.ndim == 4 else log_gate[..., None]).exp()  # (one per head: a last axis of 1)

# the RMS normalisation of the delta-rule heads' outputs: mean square + this, under the root
DELTA_OUTPUT_EPS = 1e-5


class DeltaHeads(GlobalHeads):
    """The delta rule as DeltaNet has it (``ops/delta``): q, k and v through SiLU, q and k then
    L2-normalised in the compute dtype, a writing strength b_t = sigmoid(x_t W_b) per head and
    token, each head's output RMS-normalised; with the forget gate, Gated DeltaNet. Causal only,
    one decay per head, no blind spot. Arguments as ``GlobalHeads``'."""

    # open (sigmoid(3) = 0.95): from the default (gates near 0.5) gated heads did not learn
    # recall (docs/layers.md, "Delta-rule heads")
    output_gate_bias = 3.0

    def __init__(self, dim, heads, dim_qk, dim_head, causal, feature_map=None, **settings):
        if not causal:
            raise ValueError("update_rule='delta' is a causal recurrence: it needs causal=True self-attention (no "
                             "receives_context)")
        blindspot_size = settings.get("blindspot_size", 1)
        for name, value, why in (
            ("feature_map", feature_map, "the delta rule L2-normalises q and k itself"),
            ("blindspot_size", None if blindspot_size == 1 else blindspot_size,
             "the delta rule's state takes every key as it comes"),
        ):
            if value is not None:
                raise ValueError(f"{name} is a setting of the additive rule, not of update_rule='delta': {why}")
        if (settings.get("gate_settings") or {}).get("granularity") == "feature":
            raise ValueError("gate_granularity='feature' is not supported with update_rule='delta': its forget gate "
                             "is one decay per head (Gated DeltaNet)")
        super().__init__(dim, heads, dim_qk, dim_head, causal, **settings)
        self.to_beta = nn.Linear(dim, heads, bias=False)

    def check_slice(self, length):
        raise ValueError("context_parallel is not supported with update_rule='delta': its state is not a sum the "
                         "ranks could exchange; run the sequence on one process")

    def empty_cache(self, batch_size, device=None, dtype=torch.float32):
        kv = torch.zeros(batch_size, self.heads, self.dim_qk, self.dim_head, device=device,
                         dtype=torch.promote_types(dtype, torch.float32))
        return DeltaCache(kv, self.empty_conv(batch_size, device, dtype))

    def forward(self, q, k, v, x, mask, place, cache=None):
        if self.local_conv is not None:
            q, k, v = self.convolve(q, k, v, mask, place, cache)
        q, k = (F.normalize(F.silu(t.to(compute_dtype(t))), dim=-1) for t in (q, k))
        v = F.silu(v)
        beta = torch.sigmoid(self.to_beta(x)).transpose(1, 2)  # (b, h, n)
        log_gate = None if self.forget_gate is None else self.forget_gate(x)
        if place.step:
            state = cache.kv
            one = [None if t is None else t[:, :, 0].to(state.dtype) for t in (q, k, v, beta, log_gate)]
            out = delta_rule_step(state, *one)[:, :, None]
        else:
            continued = cache is not None and place.position != 0
            out = chunk_delta_rule(q, k, v, beta, log_gate, mask, state=cache.kv if continued else None,
                                   return_state=cache is not None, segments=place.segments,
                                   chunk_size=self.chunk_size, kernel=self.kernel)
            if cache is not None:
                out, state = out
                with torch.no_grad():
                    cache.kv.copy_(state)
        out = out.to(compute_dtype(out))  # (float32 or wider: a half-precision sum of squares could overflow)
        # (one eps for every dtype: float32 and float64 then compute the same function)
        return F.rms_norm(out, (out.shape[-1],), eps=DELTA_OUTPUT_EPS).to(v.dtype)


GLOBAL_HEADS = {"additive": AdditiveHeads, "delta": DeltaHeads}
