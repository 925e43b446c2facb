"""Attention layers: global linear heads, Q(KᵀV), side by side with local windowed softmax heads.

The mixed layer: of ``heads`` heads, the first ``n_local_attn_heads`` attend with an exact
softmax inside a sliding window (``ops/windowed_attention.py``: by default each window of w
tokens looks at itself and the window before), the others attend to the whole sequence with linear
attention (``ops``). Local heads see the neighbourhood sharply, global heads see everything
at a cost linear in n.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from .cache import NO_KEY, AttentionCache, GlobalCache, LocalCache, for_call
from .context_parallel import (context_parallel_causal_linear_attention, context_parallel_linear_attention,
                               exchange_boundaries)
from .gating import ForgetGate, LocalConv, OutputGate
from .ops import FeatureMap, causal_linear_attention, linear_attention, linear_attention_readout, linear_attention_summary
from .ops.causal.forms import CHUNK_SIZE
from .ops.common import NEG_INF, check_int, check_mask, compute_dtype, dropout
from .ops.kernels import check_kernel
from .ops.causal.recurrent import CausalState, join_flags
from .ops.delta import chunk_delta_rule, delta_rule_step
from .ops.segments import aligned_layout, from_layout, to_layout
from .ops.windowed_attention import Window, windowed_attention, windowed_attention_by_position, windowed_attention_step
from .ops.windowed_flex import flex_windowed_attention, local_implementation
from .place import PLAIN, Place
from .positional import apply_rotary

# the default width of a local head's window; the model also strides attend_axially by it and
# shapes its axial position table with it
LOCAL_WINDOW_SIZE = 128
HEADS = 8  # the default number of heads of every attention layer and model
UPDATE_RULES = ("additive", "delta")  # how the global heads' state takes a key and value


def resolve_heads(dim, heads, dim_head=None, kv_heads=None, one_kv_head=False):
    """Check the head arithmetic once, with errors that name the argument.
    Returns (dim_head, kv_heads)."""
    check_int("heads", heads)
    if dim_head is None:
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}) when dim_head is not given")
        dim_head = dim // heads
    check_int("dim_head", dim_head)
    if one_kv_head:
        if kv_heads not in (None, 1):
            raise ValueError(f"one_kv_head=True means kv_heads=1, got kv_heads={kv_heads}")
        kv_heads = 1
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads!r}) must be a positive int that divides heads ({heads})")
    return dim_head, kv_heads


def resolve_dim_qk(dim_qk, dim_head):
    """The global heads' query/key width: ``dim_qk``, checked, or dim_head when not given."""
    if dim_qk is None:
        return dim_head
    check_int("dim_qk", dim_qk)
    return dim_qk


def pad_to_multiple(t, multiple, dim, value=0.0):
    pad = -t.shape[dim] % multiple
    if not pad:
        return t
    widths = [0, 0] * (t.ndim - 1 - (dim % t.ndim)) + [0, pad]
    return F.pad(t, widths, value=value)


def refuse_unread_context(receives_context, context, context_mask, what):
    """Raise ValueError when ``context`` / ``context_mask`` reach a ``what`` ('layer',
    'model') built without ``receives_context``: it would not read them."""
    if not receives_context and (context is not None or context_mask is not None):
        raise ValueError(f"context / context_mask given, but this {what} was built without receives_context=True: "
                         "build it with receives_context=True to attend to a context")


# the RMS normalisation of the delta-rule heads' outputs: mean square + this, under the root
DELTA_OUTPUT_EPS = 1e-5
# the output gate's starting bias beside delta-rule heads: open (sigmoid(3) = 0.95); from the
# default (gates near 0.5) the gated heads did not learn recall (docs/layers.md, "Delta-rule heads")
DELTA_OUTPUT_GATE_BIAS = 3.0


class Attention(nn.Module):
    """Multi-head attention with global linear heads and local softmax heads (each option's
    meaning and default: docs/layers.md).

    Args:
        dim: model width. heads: number of query heads. dim_head: size of each (dim // heads).
        dim_qk: the width of the global heads' queries and keys (default dim_head); their
            values, and every local head's q, k and v, keep dim_head. A feature map that grows
            with its input ('taylor': 1 + d + d (d + 1) / 2 features of d) then runs on a small
            q/k while the heads' outputs keep their width. With kv_heads, each key/value head
            serves query heads of one kind (n_local_attn_heads a multiple of heads // kv_heads).
        causal: each position attends only to itself and the past.
        n_local_attn_heads: how many of the heads are local windowed softmax heads, with
            ``local_attn_window_size`` (w, default ``LOCAL_WINDOW_SIZE``),
            ``local_attn_look_backward`` / ``local_attn_look_forward`` (windows before / after
            its own) and ``local_attn_exact_windowsize`` (``ops/windowed_attention.py``).
        blindspot_size: B; causal global heads see only keys in earlier blocks of B tokens.
        kv_heads: number of key/value heads, shared by groups of query heads (one_kv_head: 1).
        feature_map: the global heads' ('softmax' by default, 'elu', 'relu', 'taylor' or a
            callable, ``ops/feature_maps.py``) under the additive rule.
        update_rule: how the causal global heads' state takes each key and value: 'additive'
            (S_t = a_t S_{t-1} + phi(k_t) v_tᵀ, read normalised) or 'delta' (``ops/delta``:
            the value stored under k_t is replaced, b_t = sigmoid(x_t W_b) per head, q, k and v
            through SiLU, q and k L2-normalised, each head's output RMS-normalised; with
            ``use_gate`` the forget gate a_t, Gated DeltaNet).
        attn_dropout: dropout on the heads' output, before the output projection.
        dropout: dropout on the layer output.
        receives_context: keys and values come from ``context`` (cross-attention); all
            heads are then global and non-causal with respect to the context.
        chunk_size: chunk length of the causal kernel (``ops.causal.forms.CHUNK_SIZE``).
        use_gate: forget and output gates (``gating.py``) with ``gate_rank``,
            ``gate_temperature`` and ``gate_granularity``.
        use_local_conv: a convolution of ``local_conv_kernel`` taps on the global heads' q, k, v.
        kernel: which kernels run (docs/kernels.md's table): 'auto' (on CUDA the causal
            global heads on flash-linear-attention where it serves, the local heads on
            flex_attention), 'torch' (this library's kernels only) or 'fla' (the causal global
            heads on fla, the ``[cuda]`` extra; a call it cannot run raises).
    Shapes:
        x (b, n, dim); input_mask (b, n) bool; context (b, m, dim); context_mask (b, m) bool;
        rotary: (cos, sin) of the positions, each (n, dim_head) or (b, n, dim_head); with a
        dim_qk other than dim_head (n, dim_head + dim_qk): the local heads' angles, then the
        global heads' (``RotaryEmbedding(dim_head, dim_qk=dim_qk)``);
        segment_ids (b, n) integer: packed sequences, see ``forward``. Returns (b, n, dim).
    """

    def __init__(
        self, dim, heads=HEADS, dim_head=None, causal=False, n_local_attn_heads=0, local_attn_window_size=None,
        local_attn_look_backward=1, local_attn_look_forward=None, local_attn_exact_windowsize=False,
        blindspot_size=None, kv_heads=None, one_kv_head=False, feature_map=None, attn_dropout=0.0,
        dropout=0.0, receives_context=False, chunk_size=None, use_gate=False, gate_rank=None,
        gate_temperature=None, gate_granularity=None, use_local_conv=False, local_conv_kernel=None,
        kernel="auto", dim_qk=None, update_rule="additive"
    ):
        super().__init__()
        dim_head, kv_heads = resolve_heads(dim, heads, dim_head, kv_heads, one_kv_head)
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads ({n_local_attn_heads}) must be between 0 and heads ({heads})")
        if dim_qk is not None and n_local_attn_heads == heads:
            raise ValueError("dim_qk sizes the global heads' queries and keys, and every head of this layer is local "
                             "(n_local_attn_heads == heads): leave dim_qk unset")
        dim_qk = resolve_dim_qk(dim_qk, dim_head)
        group = heads // kv_heads
        if dim_qk != dim_head and n_local_attn_heads % group:
            raise ValueError(f"dim_qk={dim_qk} with kv_heads={kv_heads}: each key/value head serves {group} query heads, "
                             f"and with n_local_attn_heads={n_local_attn_heads} one would serve local heads (keys of "
                             f"dim_head={dim_head}) and global heads (keys of dim_qk) at once; make n_local_attn_heads a "
                             f"multiple of {group}")
        if receives_context and n_local_attn_heads:
            raise ValueError("a layer with receives_context=True has no local heads (n_local_attn_heads must be 0)")
        if local_attn_window_size is not None and not n_local_attn_heads:
            raise ValueError("local_attn_window_size is a setting of local heads, and n_local_attn_heads is 0")
        local_attn_window_size = LOCAL_WINDOW_SIZE if local_attn_window_size is None else local_attn_window_size
        if n_local_attn_heads:
            check_int("local_attn_window_size", local_attn_window_size)
        # both shape the causal kernel only: given to a layer without a causal order they would be ignored
        check_kernel(kernel)
        for name, value in (("blindspot_size", blindspot_size), ("chunk_size", chunk_size),
                            ("kernel", "fla" if kernel == "fla" else None)):
            if value is not None and not (causal and not receives_context):
                raise ValueError(f"{name} applies to causal self-attention; this layer is not causal")
        if kernel == "fla" and n_local_attn_heads == heads:
            raise ValueError("kernel='fla' runs the causal global heads, and every head of this layer is local")
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"update_rule must be one of {UPDATE_RULES}, got {update_rule!r}")
        if update_rule == "delta":
            _check_delta_rule(causal and not receives_context, heads - n_local_attn_heads, blindspot_size, feature_map,
                              gate_granularity)
        blindspot_size = 1 if blindspot_size is None else blindspot_size
        chunk_size = CHUNK_SIZE if chunk_size is None else chunk_size
        check_int("blindspot_size", blindspot_size)

        self.dim, self.heads, self.dim_head, self.kv_heads, self.dim_qk = dim, heads, dim_head, kv_heads, dim_qk
        self.causal = causal and not receives_context
        self.receives_context, self.n_local = receives_context, n_local_attn_heads
        self.local_window = _local_window(local_attn_window_size, local_attn_look_backward, local_attn_look_forward,
                                          local_attn_exact_windowsize, self.causal)
        self.blindspot_size, self.chunk_size = blindspot_size, chunk_size
        self.kernel, self.update_rule = kernel, update_rule
        # the delta rule's keys are L2-normalised: no feature map
        self.feature_map = None if update_rule == "delta" else FeatureMap("softmax" if feature_map is None else feature_map)

        n_global = heads - n_local_attn_heads
        # the local heads first, then the global ones; keys likewise, then the values
        q_width = n_local_attn_heads * dim_head + n_global * dim_qk
        self.kv_widths = (q_width // group, kv_heads * dim_head)
        self.to_q = nn.Linear(dim, q_width, bias=False)
        self.to_kv = nn.Linear(dim, sum(self.kv_widths), bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        # the delta rule's writing strength b_t, one per global head and token
        self.to_beta = nn.Linear(dim, n_global, bias=False) if update_rule == "delta" else None
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.dropout = nn.Dropout(dropout)
        if not isinstance(use_gate, bool) or not isinstance(use_local_conv, bool):
            raise ValueError("use_gate and use_local_conv must be True or False")
        # the settings given, under the names of the modules that default and check them
        gate_settings = _given(rank=gate_rank, temperature=gate_temperature, granularity=gate_granularity)
        conv_settings = _given(kernel_size=local_conv_kernel)
        # a setting without its switch would be silently ignored: refuse it instead
        if not use_gate and gate_settings:
            raise ValueError("gate_rank / gate_temperature / gate_granularity are settings of use_gate=True")
        if not use_local_conv and conv_settings:
            raise ValueError("local_conv_kernel is a setting of use_local_conv=True")
        self.forget_gate = self.output_gate = self.local_conv = None
        if use_gate:
            if n_global:
                # per feature: one decay per row of the state, a feature of the global heads' keys
                self.forget_gate = ForgetGate(dim, n_global, self._key_features(), **gate_settings)
            else:  # still check the settings: they must not be accepted silently
                ForgetGate(1, 1, 1, **gate_settings)
            self.output_gate = OutputGate(dim, heads * dim_head,
                                          DELTA_OUTPUT_GATE_BIAS if update_rule == "delta" else None)
        if use_local_conv and receives_context:
            raise ValueError("use_local_conv applies to self-attention; a cross-attention layer has no sequence to convolve along")
        # q, k, v grouped by width: a decoding step convolves each group at once
        self.conv_groups = ((0, 1, 2),) if dim_qk == dim_head else ((0, 1), (2,))
        if use_local_conv and n_global:
            self.local_conv = nn.ModuleList(
                [LocalConv(n_global * width, causal=self.causal, **conv_settings)
                 for width in (dim_qk, dim_qk, dim_head)]
            )
        elif use_local_conv:  # still check the argument: it must not be accepted silently
            LocalConv(1, causal=self.causal, **conv_settings)

    def _key_features(self):
        """The rows of the global heads' state: the feature map's features of a dim_qk key, or
        the key itself under the delta rule."""
        return self.dim_qk if self.feature_map is None else self.feature_map.feature_dim(self.dim_qk)

    def project(self, x, source):
        """Queries from x, keys/values from source: ((q, k, v) of the local heads, (q, k, v) of
        the global heads), each (b, h, n, dim_head) but the global heads' q and k (b, h, n,
        dim_qk); a kind of head the layer lacks gets None."""
        k, v = self.to_kv(source).split(self.kv_widths, dim=-1)
        v = self._by_kind(self._query_heads(split_heads(v, self.kv_heads)))
        if self.dim_qk == self.dim_head:  # one width: a key head may serve local and global heads
            q = split_heads(self.to_q(x), self.heads)
            k = split_heads(k, self.kv_heads)
            q, k = self._by_kind(q), self._by_kind(self._query_heads(k))
        else:
            group = self.heads // self.kv_heads
            q = _split_kinds(self.to_q(x), self.n_local, self.heads - self.n_local, self.dim_head, self.dim_qk)
            k = _split_kinds(k, self.n_local // group, (self.heads - self.n_local) // group, self.dim_head, self.dim_qk)
            k = [None if t is None else self._query_heads(t) for t in k]
        return tuple(None if t[0] is None else t for t in zip(q, k, v))

    def _query_heads(self, t):
        """Key/value heads (b, kv_heads or fewer, n, d) repeated for the query heads they serve."""
        if self.kv_heads == self.heads:
            return t
        return repeat(t, "b g n d -> b (g r) n d", r=self.heads // self.kv_heads)

    def _by_kind(self, t):
        """Every head (b, heads, n, d) -> (local heads, global heads), None for a kind without
        heads. One split: its backward is one cat, where two slices would each fill a full-size
        zero gradient and copy into it; no split for one kind (its backward would copy for nothing)."""
        if not self.n_local or self.n_local == self.heads:
            return (t, None) if self.n_local else (None, t)
        return t.split((self.n_local, self.heads - self.n_local), dim=1)

    def _rotary_by_kind(self, rotary):
        """The rotary tables (cos, sin) -> (the local heads', the global heads')."""
        dh, dqk = self.dim_head, self.dim_qk
        width = dh if dqk == dh else dh + dqk
        if rotary[0].shape[-1] != width:
            raise ValueError(f"rotary tables must have {width} features per position ("
                             + ("dim_head" if dqk == dh else "dim_head + dim_qk") + f"), got {rotary[0].shape[-1]}")
        if dqk == dh:
            return rotary, rotary
        if dqk % 2:
            raise ValueError(f"rotary embeddings need an even dim_qk, got {dqk}")
        return tuple(t[..., :dh] for t in rotary), tuple(t[..., dh:] for t in rotary)

    def local_heads(self, q, k, v, mask, segments=None):
        """Windowed softmax attention (positions come from the model, not from the window); its
        implementation by the kernel and the device (docs/kernels.md: flex_attention on CUDA)."""
        if local_implementation(q.device, q.dtype, self.kernel, q.shape[-1]) == "flex":
            return flex_windowed_attention(q, k, v, self.local_window, mask, segments)
        return windowed_attention(q, k, v, self.local_window, mask, segments)

    def noncausal_keys(self, k, mask, source, segments=None):
        """Key features without a causal order; with ``use_gate`` the forget gate's values,
        computed from ``source``, gate each key's contribution (then rows need normalising).
        Returns (features, normalize)."""
        k, normalize = self.feature_map.noncausal_keys(k, mask, segments)
        key_gates = self._key_gates(source)
        if key_gates is not None:
            k, normalize = k * key_gates.to(k.dtype), True
        return k, normalize

    def _key_gates(self, source):
        """The forget gate's factor on each key without a causal order (b, h, n, 1 or d), or None."""
        if self.forget_gate is None:
            return None
        log_gate = self.forget_gate(source)
        return (log_gate if log_gate.ndim == 4 else log_gate[..., None]).exp()  # (one per head: a last axis of 1)

    def global_heads(self, q, k, v, mask, x, cache=None, place=PLAIN, segments=None, group=None):
        """Linear attention over the global heads. ``cache``: a ``GlobalCache`` at ``place``,
        continued from (unless at position 0) and updated in place; on ``place.step`` the
        state's recurrence. ``group``: a ``ContextParallel`` when the sequence is split over
        processes: the slice then reads the other ranks' summaries (``context_parallel.py``)."""
        position = place.position
        fresh = not place.step and (cache is None or position == 0)
        if self.local_conv is not None and group is not None:
            q, k, v = self._convolve_context_parallel(q, k, v, mask, group)
        elif self.local_conv is not None:
            keep = (None,) * 3 if cache is None else [t for group in cache.conv for t in group.unbind(1)]  # (in place)
            previous = (None,) * 3 if fresh else keep
            q, k, v = (conv(t, mask, p, segments, kept)
                       for conv, t, p, kept in zip(self.local_conv, (q, k, v), previous, keep))
        if self.update_rule == "delta":
            return self._delta_heads(q, k, v, mask, x, cache, place.step, fresh, segments)
        fm = self.feature_map
        if self.causal:
            log_gate = None if self.forget_gate is None else self.forget_gate(x)
            q, k, exp_features = fm.causal_features(q, k)
            if group is not None:
                return context_parallel_causal_linear_attention(q, k, v, group, log_gate, mask, self.chunk_size,
                                                                exp_features, self.blindspot_size, self.kernel)
            if place.step:
                return self._global_heads_step(q, k, v, log_gate, cache.state, place.start, place.row_starts)
            out = causal_linear_attention(
                q, k, v, log_gate, mask, blindspot_size=self.blindspot_size, chunk_size=self.chunk_size,
                exp_features=exp_features, state=None if fresh else cache.state.as_causal_state(position),
                return_state=cache is not None, segments=segments, kernel=self.kernel,
            )
            if cache is None:
                return out
            out, state = out
            with torch.no_grad():
                cache.state.load(state)
            return out
        if group is not None:  # the softmax map's keys take their softmax over the whole sequence
            key_gates, softmax = self._key_gates(x), fm.is_softmax
            keys = k if softmax else fm.noncausal_keys(k, mask)[0]
            return context_parallel_linear_attention(fm.queries(q), keys, v, group, mask, softmax_keys=softmax,
                                                     normalize=not softmax or key_gates is not None, key_scale=key_gates)
        k, normalize = self.noncausal_keys(k, mask, x, segments)
        return linear_attention(fm.queries(q), k, v, mask, normalize=normalize, segments=segments)

    def _delta_heads(self, q, k, v, mask, x, cache, step, fresh, segments):
        """The global heads under the delta rule (``ops/delta``), as DeltaNet has them: q, k
        and v through SiLU, q and k then L2-normalised in the compute dtype, and each head's
        output RMS-normalised; ``cache``: a ``GlobalCache`` whose state holds S (b, h, d, e),
        continued from (unless ``fresh``) and updated in place; one token in place on a
        ``step``."""
        q, k = (F.normalize(F.silu(t.to(compute_dtype(t))), dim=-1) for t in (q, k))
        v = F.silu(v)
        beta = torch.sigmoid(self.to_beta(x)).transpose(1, 2)  # (b, h, n)
        log_gate = None if self.forget_gate is None else self.forget_gate(x)
        if step:
            state = cache.state.kv
            one = [None if t is None else t[:, :, 0].to(state.dtype) for t in (q, k, v, beta, log_gate)]
            out = delta_rule_step(state, *one)[:, :, None]
        else:
            out = chunk_delta_rule(q, k, v, beta, log_gate, mask, state=None if fresh else cache.state.kv,
                                   return_state=cache is not None, segments=segments, chunk_size=self.chunk_size,
                                   kernel=self.kernel)
            if cache is not None:
                out, state = out
                with torch.no_grad():
                    cache.state.kv.copy_(state)
        out = out.to(compute_dtype(out))  # (float32 or wider: a half-precision sum of squares could overflow)
        # (one eps for every dtype: float32 and float64 then compute the same function)
        return F.rms_norm(out, (out.shape[-1],), eps=DELTA_OUTPUT_EPS).to(v.dtype)

    def _global_heads_step(self, q, k, v, log_gate, state, position, row_starts=None):
        """One token per row through the state (``CausalState.step``, in place): q, k (b, h, 1,
        d) (logits with exponential features), v (b, h, 1, e), log_gate (b, h, 1[, d]) or None;
        computed in the state's dtype (float32 or wider). ``position``: an int (a blindspot block
        then joins only where it ends) or a long tensor (joined by flags at every position)."""
        dtype, out_dtype = state.kv.dtype, v.dtype
        q, k, v = (t[:, :, 0] if t.dtype == dtype else t[:, :, 0].to(dtype) for t in (q, k, v))
        if log_gate is not None:
            log_gate = log_gate[:, :, 0] if log_gate.dtype == dtype else log_gate[:, :, 0].to(dtype)
        where, blindspot = None, self.blindspot_size
        if blindspot > 1 and not (isinstance(position, int) and (position + 1) % blindspot):  # (else no join now)
            zero = state.kv.new_zeros(())
            where = join_flags(position, blindspot, state.ref is not None, zero, zero + NEG_INF)
        # every row has seen a key (read_state then needs no guard) once the first block is
        # behind, where rows start together (left-padded rows count from their own start)
        seen = isinstance(position, int) and row_starts is None and position >= (blindspot if blindspot > 1 else 0)
        out = state.step(q, k, v, log_gate, where, all_seen=seen)[:, :, None]
        return out if out.dtype == out_dtype else out.to(out_dtype)

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

    def _local_heads_context_parallel(self, q, k, v, mask, group):
        """Local heads across the slice's ends: the neighbours' boundary windows of keys and
        values (look_backward * w before, look_forward * w after) extend the slice; the
        queries are padded alike and their outputs cut back (windows stay aligned: the slice
        length is a multiple of w)."""
        window = self.local_window
        before, after = window.look_backward * window.size, window.look_forward * window.size
        mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if mask is None else mask
        (kb, ka), (vb, va), (mb, ma) = exchange_boundaries([(k, 2), (v, 2), (mask, 1)], group, before, after)
        n = q.shape[2]
        q = F.pad(q, (0, 0, before, after))
        k, v = torch.cat((kb, k, ka), dim=2), torch.cat((vb, v, va), dim=2)
        out = windowed_attention(q, k, v, window, torch.cat((mb, mask, ma), dim=1))
        return out[:, :, before : before + n]

    def check_place(self, place, length, parallel=False):
        """Raise ValueError naming what this layer cannot do at ``place`` (``place.py``) for x
        of ``length`` tokens (one rank's slice when ``parallel``)."""
        if place.cached:
            self.check_cacheable()
            if place.row_starts is not None and self._blindspot_blocks():
                raise ValueError(f"blindspot_size={self.blindspot_size} with rows padded on the left (input_mask) in a "
                                 "cache: each row's blocks would start at another column; run the rows apart, pad on "
                                 "the right, or use blindspot_size=1")
        if place.segments is not None and self.receives_context:
            raise ValueError("segment_ids is not supported in a cross-attention layer (receives_context=True)")
        if not parallel:
            return
        window = self.local_window
        if self.receives_context:
            raise ValueError("context_parallel is not supported with a cross-attention layer (receives_context=True) yet")
        if self.update_rule == "delta":
            raise ValueError("context_parallel is not supported with update_rule='delta': its state is not a sum the "
                             "ranks could exchange; run the sequence on one process")
        if self.n_local and length % window.size:
            raise ValueError(f"context_parallel with local heads needs slices of a multiple of "
                             f"local_attn_window_size={window.size} tokens, got {length}")
        if self.n_local and length < max(window.look_backward, window.look_forward) * window.size:
            raise ValueError(f"context_parallel with local heads needs slices of at least local_attn_look_backward "
                             f"(and local_attn_look_forward) * local_attn_window_size tokens, got {length}")
        if self.n_local < self.heads and self.causal and length % self.blindspot_size:
            raise ValueError(f"context_parallel needs slices of a multiple of blindspot_size={self.blindspot_size} "
                             f"tokens, got {length}")
        if self.local_conv is not None and length < self.local_conv[0].kernel_size - 1:
            raise ValueError(f"context_parallel needs slices of at least local_conv_kernel - 1 tokens, got {length}")

    def forward(self, x, input_mask=None, context=None, context_mask=None, rotary=None, cache=None,
                return_cache=False, segment_ids=None, context_parallel=None):
        """x (b, n, dim) -> (b, n, dim); with ``return_cache`` -> (out, AttentionCache).

        ``cache``: the ``AttentionCache`` returned for the tokens before x (causal layers
        only): x then holds just the new tokens; the cache is updated in place (``cache.py``).
        ``segment_ids`` (packed sequences, docs/packed.md) and ``context_parallel`` (docs/scale.md)
        as in ``LinearAttentionTransformer.forward``; ``input_mask`` and ``rotary`` are then
        the slice's. What this layer cannot do there raises ValueError (``check_place``).

        An argument this kind of layer would not read raises ValueError (a self-attention layer's
        ``context``, a cross-attention layer's ``input_mask`` and ``rotary``: ``_check_routes``).
        A model calls ``attend`` with the ``Place`` it made once."""
        if x.ndim != 3 or x.shape[-1] != self.dim or x.shape[1] < 1:
            raise ValueError(f"x must have shape (batch, seq_len >= 1, {self.dim}), got {tuple(x.shape)}")
        self._check_routes(input_mask, context, context_mask, rotary)
        place = Place.of(x, cache, return_cache, segment_ids, context_parallel, check=self.check_place)
        if place.cached:
            cache = self.empty_cache(x.shape[0], x.device, x.dtype, 0) if cache is None else for_call(cache, return_cache)
        out = self.attend(x, place.but(rotary=rotary), input_mask, cache, context, context_mask)
        if cache is not None:  # (a layer on its own counts its tokens; in a model the model counts)
            cache.position.add_(x.shape[1])
        return (out, cache) if return_cache else out

    def attend(self, x, place=PLAIN, input_mask=None, cache=None, context=None, context_mask=None):
        """The output for x (b, n, dim) at ``place`` (``place.py``, checked by ``check_place``);
        ``cache``: this layer's ``AttentionCache`` when ``place.cached``, updated in place."""
        check_mask(input_mask, *x.shape[:2], "input_mask")
        if self.receives_context:
            out = self._cross_attention(x, context, context_mask, cache)
        elif place.segments is not None:
            out = self._packed(x, input_mask, place)
        elif place.row_starts is not None and not place.cached and self._blindspot_blocks():
            # rows padded on the left: each row's blocks start at its first real token
            out = self._packed(x, input_mask, place.but(segments=place.row_runs(x.shape[1], x.device)))
        else:
            out = self._self_attention(x, input_mask, place, cache)
        return out

    def _check_routes(self, input_mask, context, context_mask, rotary):
        """Refuse the forward arguments this kind of layer would not read (never ignore one)."""
        if self.receives_context:
            for name, value in (("input_mask", input_mask), ("rotary", rotary)):
                if value is not None:
                    raise ValueError(f"{name} is not read by a cross-attention layer (receives_context=True): its keys "
                                     "come from the context (mask them with context_mask), with no positions shared "
                                     "with the queries")
        refuse_unread_context(self.receives_context, context, context_mask, "layer")

    def _blindspot_blocks(self):
        """Whether causal global heads see keys by blocks of blindspot_size > 1 tokens."""
        return self.blindspot_size > 1 and self.causal and self.n_local < self.heads

    def _packed(self, x, mask, place):
        """Self-attention over packed segments. Blindspot blocks must start with each segment:
        each is moved to start at a multiple of B (``aligned_layout``), the layer runs there,
        and the outputs are moved back."""
        runs, rotary = place.segments, place.rotary
        if self.blindspot_size == 1 or self.n_local == self.heads:
            return self._self_attention(x, mask, place)
        slots, length = aligned_layout(runs, self.blindspot_size)
        mask = torch.ones_like(runs, dtype=torch.bool) if mask is None else mask
        if rotary is not None:
            rotary = tuple(to_layout(t.expand(x.shape[0], *t.shape[-2:]), slots, length) for t in rotary)
        # an empty slot belongs to the segment before it (cummax of the moved run index)
        moved_runs = to_layout(runs, slots, length).cummax(dim=1).values
        out = self._self_attention(to_layout(x, slots, length), to_layout(mask, slots, length, False),
                                   place.but(segments=moved_runs, rotary=rotary))
        return from_layout(out, slots)

    def _self_attention(self, x, input_mask, place, cache=None):
        """The output; ``cache``: an ``AttentionCache`` to continue from at ``place``, updated
        in place. On a ``place.step`` each kind of head takes its recurrent form."""
        rotary, segments, group = place.rotary, place.segments, place.group
        kinds = self.project(x, x)
        if rotary is not None:
            kinds = [None if kind is None else (apply_rotary(kind[0], tables), apply_rotary(kind[1], tables), kind[2])
                     for kind, tables in zip(kinds, self._rotary_by_kind(rotary))]
        (ql, kl, vl), (qg, kg, vg) = ((None,) * 3 if kind is None else kind for kind in kinds)
        fresh = not place.step and (cache is None or place.position == 0)
        outs = []
        if self.n_local:
            if group is not None:
                outs.append(self._local_heads_context_parallel(ql, kl, vl, input_mask, group))
            elif place.step:
                outs.append(self._local_heads_step(ql, kl, vl, cache.local, place))
            elif fresh:
                # (rows padded on the left: each row's windows start at its first real token)
                runs = segments if segments is not None else place.row_runs(x.shape[1], x.device)
                outs.append(self.local_heads(ql, kl, vl, input_mask, runs))
            else:
                outs.append(self._local_heads_cached(ql, kl, vl, input_mask, cache.local, place.position,
                                                     place.row_starts))
            if cache is not None and not place.step:
                cache.local.write(kl, vl, place.position, input_mask, place.row_starts)
        if self.n_local < self.heads:
            outs.append(self.global_heads(qg, kg, vg, input_mask, x, None if cache is None else cache.global_, place,
                                          segments, group))
        return self._combine(outs, x)

    def _combine(self, outs, x):
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = out.transpose(1, 2).flatten(2)  # (b, h, n, d) -> (b, n, h d)
        if self.output_gate is not None:
            out = out * self.output_gate(x)
        return dropout(self.dropout, self.to_out(dropout(self.attn_dropout, out)))

    def _local_heads_cached(self, q, k, v, mask, cache, position, row_starts=None):
        """The new queries over the ring's keys and their own (before they are written);
        positions count from each row's first real column when ``row_starts`` (b,) is given."""
        n = q.shape[2]
        keys, values = (torch.cat((stored, new.to(stored.dtype)), dim=2) for stored, new in zip(cache.kv.unbind(1), (k, v)))
        q_positions = torch.arange(position, position + n, device=q.device)
        if row_starts is not None:
            q_positions = q_positions - row_starts[:, None]
        new_positions = q_positions.expand(q.shape[0], n) if mask is None else torch.where(mask, q_positions, NO_KEY)
        k_positions = torch.cat((cache.positions, new_positions), dim=1)  # NO_KEY: before every window
        return windowed_attention_by_position(q, keys, values, q_positions, k_positions, self.local_window)

    def _local_heads_step(self, q, k, v, ring, place):
        """One query per row (b, h, 1, d) over the ring (``LocalCache``). Its own key and value
        enter their slot first: the key they replace is older than this query's window."""
        ring.write(k, v, place.start, None, place.row_starts)
        p = place.start if place.row_starts is None else (place.start - place.row_starts)[:, None]
        hidden = ring.positions < self.local_window.first_key(p)  # (an empty slot's NO_KEY lies below every window)
        bias = torch.zeros(hidden.shape, dtype=ring.kv.dtype, device=hidden.device).masked_fill_(hidden, NEG_INF)
        keys, values = ring.kv.unbind(1)
        out = windowed_attention_step(q * q.shape[-1] ** -0.5, keys, values, bias[:, None])
        return out[:, :, None]

    def _cross_attention(self, x, context, context_mask, cache):
        """Cross-attention: the context is reduced to kᵀv once (on the first call), then read."""
        if cache is None or cache.context is None:
            if context is None:
                raise ValueError("this layer has receives_context=True: pass context=(batch, ctx_len, dim)")
            if context.ndim != 3 or context.shape[-1] != self.dim or context.shape[0] != x.shape[0]:
                raise ValueError(f"context must have shape ({x.shape[0]}, ctx_len, {self.dim}), got {tuple(context.shape)}")
            check_mask(context_mask, *context.shape[:2], "context_mask")
            _, k, v = self.project(x[:, :0], context)[1]
            k, normalize = self.noncausal_keys(k, context_mask, context)
            summary = linear_attention_summary(k, v, context_mask, normalize)
            if cache is not None:
                cache.context = summary
        else:
            summary = cache.context
        return self.read_context(x, summary)

    def read_context(self, x, summary):
        """Queries from x (b, n, dim) read the context's kᵀv ``summary`` -> (b, n, dim)."""
        q = split_heads(self.to_q(x), self.heads)
        return self._combine([linear_attention_readout(self.feature_map.queries(q), summary)], x)

    def empty_cache(self, batch_size, device=None, dtype=torch.float32, position=None):
        """The cache before any token: zero state, no keys, zero convolution inputs (a
        cross-attention layer's context is reduced on the first call); ``position``: 0 for a
        layer that counts its own tokens (``forward``), None in a model (the model counts)."""
        if position is not None:
            position = torch.tensor(position, dtype=torch.long, device=device)
        self.check_cacheable()
        n_global, dh = self.heads - self.n_local, self.dim_head
        local = global_ = None
        if self.n_local:
            local = LocalCache.zeros(batch_size, self.n_local, self.local_window.most_keys, dh, device, dtype)
        if n_global and not self.receives_context:
            state_dtype = torch.promote_types(dtype, torch.float32)
            if self.update_rule == "delta":  # S alone: no normaliser, no references
                state = CausalState(torch.zeros(batch_size, n_global, self.dim_qk, dh, device=device, dtype=state_dtype))
            else:
                state = CausalState.zeros(batch_size, n_global, self._key_features(), dh, self.blindspot_size,
                                          self.feature_map.is_softmax, device, state_dtype)
            widths = (self.dim_qk, self.dim_qk, dh)
            conv = None if self.local_conv is None else tuple(torch.zeros(
                batch_size, len(group), n_global, self.local_conv[0].kernel_size - 1, widths[group[0]], device=device,
                dtype=dtype) for group in self.conv_groups)
            global_ = GlobalCache(state, conv)
        return AttentionCache(position, local, global_, None)

    def check_cacheable(self):
        if not self.causal and not self.receives_context:
            raise ValueError("a cache (cached decoding) needs a causal model: this attention layer is not causal")
        if self.training and (self.attn_dropout.p > 0 or self.dropout.p > 0):
            raise ValueError("cached decoding needs eval mode: dropout is active (call model.eval())")


def _local_window(size, look_backward, look_forward, exact, causal):
    """Check the local window options (the ``local-attention`` package's meanings) and build the ``Window``."""
    for name, value in (("local_attn_look_backward", look_backward), ("local_attn_look_forward", look_forward)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not isinstance(exact, bool):
        raise ValueError(f"local_attn_exact_windowsize must be True or False, got {exact!r}")
    if causal and look_forward:
        raise ValueError(f"local_attn_look_forward={look_forward}: a causal layer cannot look at later windows")
    if exact and not causal:
        raise ValueError("local_attn_exact_windowsize applies to causal layers (the window ends at the query)")
    if exact and look_backward < 1:
        raise ValueError("local_attn_exact_windowsize needs local_attn_look_backward >= 1 (it sees look_backward * w keys)")
    look_forward = (0 if causal else 1) if look_forward is None else look_forward
    return Window(size, look_backward, look_forward, causal, exact)


def _check_delta_rule(causal, n_global, blindspot_size, feature_map, gate_granularity):
    """Refuse, by name, what the delta rule cannot honour."""
    if not causal:
        raise ValueError("update_rule='delta' is a causal recurrence: it needs causal=True self-attention (no "
                         "receives_context)")
    if not n_global:
        raise ValueError("update_rule='delta' sets the global heads' rule, and every head of this layer is local "
                         "(n_local_attn_heads == heads)")
    for name, value, why in (
        ("feature_map", feature_map, "the delta rule L2-normalises q and k itself"),
        ("blindspot_size", None if blindspot_size == 1 else blindspot_size,
         "the delta rule's state takes every key as it comes"),
    ):
        if value is not None:
            raise ValueError(f"{name} is a setting of the additive rule, not of update_rule='delta': {why}")
    if gate_granularity == "feature":
        raise ValueError("gate_granularity='feature' is not supported with update_rule='delta': its forget gate is "
                         "one decay per head (Gated DeltaNet)")


def split_heads(t, heads):
    """(b, n, heads * d) -> (b, heads, n, d)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _split_kinds(t, local_heads, global_heads, local_width, global_width):
    """(b, n, local_heads * local_width + global_heads * global_width) -> (local (b, local_heads,
    n, local_width), global (b, global_heads, n, global_width)), None for a kind without heads."""
    counts, widths = (local_heads, global_heads), (local_width, global_width)
    if all(counts):
        parts = t.split([c * w for c, w in zip(counts, widths)], dim=-1)
    else:  # (one kind: no split, whose backward would copy for nothing)
        parts = [t if c else None for c in counts]
    return [None if p is None else split_heads(p, c) for p, c in zip(parts, counts)]


def _given(**settings):
    """The settings that are not None: the others keep the defaults of the module they go to."""
    return {name: value for name, value in settings.items() if value is not None}


class LinearSelfAttention(Attention):
    """Global linear self-attention on its own, to drop into any model (``linear-attention``'s layer).

    Arguments as ``Attention``'s (``dim_qk``: the width of q and k, values keeping dim_head);
    ``psi_fn`` (the ``linear-attention`` package's name for a callable feature map) is accepted
    as ``feature_map``, and ``dropout`` is ``attn_dropout``.
    ``**improvements``: ``use_gate``, ``use_local_conv`` and their settings.
    Shapes: x (b, n, dim), input_mask (b, n) bool -> (b, n, dim).
    """

    def __init__(
        self, dim, heads=HEADS, causal=False, dim_head=None, kv_heads=None, one_kv_head=False,
        feature_map=None, psi_fn=None, dropout=0.0, blindspot_size=None, chunk_size=None, dim_qk=None,
        **improvements,
    ):
        if psi_fn is not None:
            if feature_map is not None:
                raise ValueError("give either feature_map or psi_fn, not both")
            if not callable(psi_fn):
                raise TypeError("psi_fn must be callable")
            feature_map = psi_fn
        super().__init__(
            dim, heads=heads, dim_head=dim_head, causal=causal, kv_heads=kv_heads, one_kv_head=one_kv_head,
            feature_map=feature_map, attn_dropout=dropout, blindspot_size=blindspot_size, chunk_size=chunk_size,
            dim_qk=dim_qk, **improvements,
        )
