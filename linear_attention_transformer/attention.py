"""Attention layers: global linear heads, Q(KᵀV), side by side with local windowed softmax heads.

The mixed layer: of ``heads`` heads, the first ``n_local_attn_heads`` attend with an exact
softmax inside a sliding window (``ops/windowed_attention.py``: by default each window of w
tokens looks at itself and the window before), the others attend to the whole sequence with linear
attention (``ops``). Local heads see the neighbourhood sharply, global heads see everything
at a cost linear in n. The layer projects q, k and v of every head at once, hands each kind of
head (``heads.py``) its share, and combines their outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import AttentionCache, for_call
from .gating import ForgetGate, LocalConv, OutputGate
from .heads import GLOBAL_HEADS, LocalHeads, WindowLinearHeads
from .ops import linear_attention_readout, linear_attention_summary
from .ops.causal.forms import CHUNK_SIZE
from .ops.common import check_int, check_mask
from .ops.kernels import check_kernel
from .ops.segments import aligned_layout, from_layout, to_layout
from .ops.windowed_attention import Window
from .place import PLAIN, Place
from .positional import apply_rotary

# the default width of a local head's window; the model also strides attend_axially by it and
# shapes its axial position table with it
LOCAL_WINDOW_SIZE = 128
HEADS = 8  # the default number of heads of every attention layer and model


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


class Attention(nn.Module):
    """Multi-head attention: local windowed softmax heads beside global linear heads, each kind
    a module of its own (``heads.py``); each option's meaning and default: docs/layers.md.

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
            ``local_attn_older_keys='linear'`` (causal, exact windows): the keys older than the
            window are read too, by linear attention through learnt features of
            ``local_attn_feature_dim`` (default dim_head), under the window's normalisation,
            the sequence's first ``local_attn_sinks`` keys (default 0) by softmax beside the
            window (``heads.WindowLinearHeads``).
        blindspot_size: B; causal global heads see only keys in earlier blocks of B tokens.
        kv_heads: number of key/value heads, shared by groups of query heads (one_kv_head: 1).
        feature_map: the global heads' ('softmax' by default, 'elu', 'relu', 'taylor' or a
            callable, ``ops/feature_maps.py``) under the additive rule.
        update_rule: the global heads' kind (``heads.GLOBAL_HEADS``): 'additive'
            (S_t = a_t S_{t-1} + phi(k_t) v_tᵀ, read normalised) or 'delta' (``DeltaHeads``:
            the value stored under k_t is replaced; with ``use_gate`` Gated DeltaNet).
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
        bias: a bias on the output projection ``to_out`` (q, k and v have none).
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
        kernel="auto", dim_qk=None, update_rule="additive", bias=True, local_attn_older_keys=None,
        local_attn_feature_dim=None, local_attn_sinks=None
    ):
        super().__init__()
        dim_head, kv_heads = resolve_heads(dim, heads, dim_head, kv_heads, one_kv_head)
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads ({n_local_attn_heads}) must be between 0 and heads ({heads})")
        n_global = heads - n_local_attn_heads
        if dim_qk is not None and not n_global:
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
        self.causal = causal and not receives_context
        for name, value in (("blindspot_size", blindspot_size), ("chunk_size", chunk_size),
                            ("kernel", "fla" if kernel == "fla" else None)):
            if value is not None and not self.causal:
                raise ValueError(f"{name} applies to causal self-attention; this layer is not causal")
        if kernel == "fla" and not n_global:
            raise ValueError("kernel='fla' runs the causal global heads, and every head of this layer is local")
        if update_rule not in GLOBAL_HEADS:
            raise ValueError(f"update_rule must be one of {tuple(GLOBAL_HEADS)}, got {update_rule!r}")
        if update_rule != "additive" and not n_global:
            raise ValueError(f"update_rule={update_rule!r} sets the global heads' rule, and every head of this layer "
                             "is local (n_local_attn_heads == heads)")
        blindspot_size = 1 if blindspot_size is None else blindspot_size
        check_int("blindspot_size", blindspot_size)
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
        if use_local_conv and receives_context:
            raise ValueError("use_local_conv applies to self-attention; a cross-attention layer has no sequence to convolve along")
        if use_gate and not n_global:  # still check the settings: they must not be accepted silently
            ForgetGate(1, 1, 1, **gate_settings)
        if use_local_conv and not n_global:
            LocalConv(1, causal=self.causal, **conv_settings)
        window = _local_window(local_attn_window_size, local_attn_look_backward, local_attn_look_forward,
                               local_attn_exact_windowsize, self.causal)
        _check_older_keys(local_attn_older_keys, local_attn_feature_dim, local_attn_sinks, n_local_attn_heads,
                          self.causal, local_attn_exact_windowsize)

        self.dim, self.heads, self.dim_head, self.kv_heads, self.dim_qk = dim, heads, dim_head, kv_heads, dim_qk
        self.receives_context, self.n_local, self.update_rule = receives_context, n_local_attn_heads, update_rule
        # the local heads first, then the global ones; keys likewise, then the values
        self.head_counts = (n_local_attn_heads, n_global)
        self.q_widths = (n_local_attn_heads * dim_head, n_global * dim_qk)
        q_width = sum(self.q_widths)
        self.kv_widths = (q_width // group, kv_heads * dim_head)
        self.k_widths = self.v_widths = None  # (None: a key/value head serves heads of both kinds)
        if n_local_attn_heads % group == 0:
            self.k_widths = (n_local_attn_heads // group * dim_head, n_global // group * dim_qk)
            self.v_widths = (n_local_attn_heads // group * dim_head, n_global // group * dim_head)
        self.to_q = nn.Linear(dim, q_width, bias=False)
        self.to_kv = nn.Linear(dim, sum(self.kv_widths), bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=bias)
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.dropout = nn.Dropout(dropout)
        self.local_heads = None
        if local_attn_older_keys == "linear":
            self.local_heads = WindowLinearHeads(n_local_attn_heads, window, dim_head,
                                                 dim_head if local_attn_feature_dim is None else local_attn_feature_dim,
                                                 local_attn_sinks or 0)
        elif n_local_attn_heads:
            self.local_heads = LocalHeads(n_local_attn_heads, window, kernel)
        self.global_heads = None
        if n_global:
            options = {} if feature_map is None else {"feature_map": feature_map}
            self.global_heads = GLOBAL_HEADS[update_rule](
                dim, n_global, dim_qk, dim_head, self.causal, use_gate=use_gate, use_local_conv=use_local_conv,
                gate_settings=gate_settings, conv_settings=conv_settings, blindspot_size=blindspot_size,
                chunk_size=CHUNK_SIZE if chunk_size is None else chunk_size, kernel=kernel, **options)
        self.head_kinds = (self.local_heads, self.global_heads)  # (a plain tuple: registered above)
        self.output_gate = OutputGate(dim, heads * dim_head) if use_gate else None
        opened = None if self.global_heads is None else self.global_heads.output_gate_bias
        if self.output_gate is not None and opened is not None:  # (the global heads' channels alone)
            with torch.no_grad():
                self.output_gate.gate_out.bias[n_local_attn_heads * dim_head:].fill_(opened)
        # whether causal global heads see keys by blocks of more than one token
        self.blindspot_blocks = self.causal and blindspot_size > 1 and n_global > 0
        self._register_load_state_dict_pre_hook(_moved_parameters)

    @property
    def cache_refusal(self):
        """Why this layer cannot decode with a cache (a sentence), or None."""
        if not self.causal and not self.receives_context:
            return "a cache (cached decoding) needs a causal model: this attention layer is not causal"
        if self.training and (self.attn_dropout.p > 0 or self.dropout.p > 0):
            return "cached decoding needs eval mode: dropout is active (call model.eval())"
        return None

    def forward(self, x, input_mask=None, context=None, context_mask=None, rotary=None, cache=None,
                return_cache=False, segment_ids=None, context_parallel=None):
        """x (b, n, dim) -> (b, n, dim); with ``return_cache`` -> (out, AttentionCache).

        ``cache``: the ``AttentionCache`` returned for the tokens before x (causal layers
        only): x then holds just the new tokens; the cache is updated in place (``cache.py``).
        ``segment_ids`` (packed sequences, docs/packed.md) and ``context_parallel`` (docs/scale.md)
        as in ``LinearAttentionTransformer.forward``; ``input_mask`` and ``rotary`` are then
        the slice's. What this layer cannot do there raises ValueError (``check_place``).

        The inputs are checked here; an argument this kind of layer would not read raises
        ValueError (a self-attention layer's ``context``, a cross-attention layer's
        ``input_mask`` and ``rotary``). A model checks its own call, then calls ``attend``."""
        if x.ndim != 3 or x.shape[-1] != self.dim or x.shape[1] < 1:
            raise ValueError(f"x must have shape (batch, seq_len >= 1, {self.dim}), got {tuple(x.shape)}")
        _check_inputs(self, x, input_mask, context, context_mask, rotary)
        place = Place.of(x, cache, return_cache, segment_ids, context_parallel, self.check_place, input_mask)
        if place.cached:
            cache = self.empty_cache(x.shape[0], x.device, x.dtype, 0) if cache is None else for_call(cache, return_cache)
        out = self.attend(x, place.but(rotary=rotary), input_mask, cache, context, context_mask)
        if cache is not None:  # (a layer on its own counts its tokens; in a model the model counts)
            cache.position.add_(x.shape[1])
        return (out, cache) if return_cache else out

    def attend(self, x, place=PLAIN, input_mask=None, cache=None, context=None, context_mask=None):
        """The output for x (b, n, dim) at ``place`` (``place.py``), its inputs checked by the
        caller; ``cache``: this layer's ``AttentionCache`` when ``place.cached``, updated in place."""
        if self.receives_context:
            return self._cross_attention(x, context, context_mask, cache)
        if self.blindspot_blocks and place.segments is not None:
            return self._packed(x, input_mask, place)
        if self.blindspot_blocks and place.row_starts is not None and not place.cached:
            # rows padded on the left: each row's blocks start at its first real token
            return self._packed(x, input_mask, place.but(segments=place.row_runs(x.shape[1], x.device)))
        return self._self_attention(x, input_mask, place, cache)

    def project(self, x, source):
        """Queries from x, keys/values from source: ((q, k, v) of the local heads, (q, k, v) of
        the global heads), each (b, h, n, dim_head) but the global heads' q and k (b, h, n,
        dim_qk); a kind of head the layer lacks gets None. Split by kind along the features:
        the backward of one split is one cat, where slices would each fill a full-size zero
        gradient and copy into it."""
        k, v = self.to_kv(source).split(self.kv_widths, dim=-1)
        group, k_widths, v_widths = self.heads // self.kv_heads, self.k_widths, self.v_widths
        if k_widths is None:  # a key/value head serves heads of both kinds: repeated before the split
            k = k.unflatten(-1, (self.kv_heads, -1)).repeat_interleave(group, dim=-2).flatten(-2)
            v = v.unflatten(-1, (self.kv_heads, -1)).repeat_interleave(group, dim=-2).flatten(-2)
            group, k_widths, v_widths = 1, self.q_widths, self.q_widths
        qs = self.to_q(x).split(self.q_widths, dim=-1)
        ks, vs = k.split(k_widths, dim=-1), v.split(v_widths, dim=-1)
        b, n, m = x.shape[0], x.shape[1], source.shape[1]
        kinds = []
        for count, q, k, v in zip(self.head_counts, qs, ks, vs):
            if not count:
                kinds.append(None)
                continue
            heads = count // group  # (widths given: a cross-attention layer projects no query to read its context)
            if n == 1 and m == 1:  # (b, 1, h d) -> (b, h, 1, d): a view, no transpose
                q, k, v = q.view(b, count, 1, -1), k.view(b, heads, 1, -1), v.view(b, heads, 1, -1)
            else:  # (b, n, h d) -> (b, h, n, d)
                q = q.view(b, n, count, q.shape[-1] // count).transpose(1, 2)
                k = k.view(b, m, heads, k.shape[-1] // heads).transpose(1, 2)
                v = v.view(b, m, heads, v.shape[-1] // heads).transpose(1, 2)
            if group > 1:  # each key/value head repeated for the query heads it serves
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            kinds.append((q, k, v))
        return kinds

    def _self_attention(self, x, input_mask, place, cache=None):
        """Each kind of head on its share of the projections, continuing its entry of ``cache``."""
        kinds = self.project(x, x)
        if place.rotary is not None:
            kinds = [None if kind is None else (apply_rotary(kind[0], tables), apply_rotary(kind[1], tables), kind[2])
                     for kind, tables in zip(kinds, self._rotary_by_kind(place.rotary))]
        entries = (None, None) if cache is None else (cache.local, cache.global_)
        outs = []
        for heads, qkv, entry in zip(self.head_kinds, kinds, entries):
            if qkv is not None:
                outs.append(heads.forward(*qkv, x, input_mask, place, entry))  # (a part of this module: no hooks)
        return self._combine(outs, x)

    def _combine(self, outs, x):
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = out.transpose(1, 2).flatten(2)  # (b, h, n, d) -> (b, n, h d)
        if self.output_gate is not None:
            out = out * self.output_gate(x)
        if self.training:
            out = self.attn_dropout(out)
        out = self.to_out(out)  # (each projection a module call: a wrapped or adapted Linear acts)
        return self.dropout(out) if self.training else out

    def _rotary_by_kind(self, rotary):
        """The rotary tables (cos, sin) -> (the local heads', the global heads')."""
        dh = self.dim_head
        if self.dim_qk == dh:
            return rotary, rotary
        return tuple(t[..., :dh] for t in rotary), tuple(t[..., dh:] for t in rotary)

    def _packed(self, x, mask, place):
        """Self-attention over packed segments with blind-spot blocks, which must start with each
        segment: each is moved to start at a multiple of B (``aligned_layout``), the layer runs
        there, and the outputs are moved back."""
        runs, rotary = place.segments, place.rotary
        slots, length = aligned_layout(runs, self.global_heads.blindspot_size)
        mask = torch.ones_like(runs, dtype=torch.bool) if mask is None else mask
        if rotary is not None:
            rotary = tuple(to_layout(t.expand(x.shape[0], *t.shape[-2:]), slots, length) for t in rotary)
        # an empty slot belongs to the segment before it (cummax of the moved run index)
        moved_runs = to_layout(runs, slots, length).cummax(dim=1).values
        out = self._self_attention(to_layout(x, slots, length), to_layout(mask, slots, length, False),
                                   place.but(segments=moved_runs, rotary=rotary))
        return from_layout(out, slots)

    def _cross_attention(self, x, context, context_mask, cache):
        """Cross-attention: the context is reduced to kᵀv once (on the first call), then read."""
        if cache is None or cache.context is None:
            _, k, v = self.project(x[:, :0], context)[1]
            k, normalize = self.global_heads.noncausal_keys(k, context_mask, context)
            summary = linear_attention_summary(k, v, context_mask, normalize)
            if cache is not None:
                cache.context = summary
        else:
            summary = cache.context
        return self.read_context(x, summary)

    def read_context(self, x, summary):
        """Queries from x (b, n, dim) read the context's kᵀv ``summary`` -> (b, n, dim)."""
        q = split_heads(self.to_q(x), self.heads)
        return self._combine([linear_attention_readout(self.global_heads.feature_map.queries(q), summary)], x)

    def empty_cache(self, batch_size, device=None, dtype=torch.float32, position=None):
        """The cache before any token: each kind's empty entry (a cross-attention layer's context
        is reduced on the first call); ``position``: 0 for a layer that counts its own tokens
        (``forward``), None in a model (the model counts)."""
        if (why := self.cache_refusal) is not None:
            raise ValueError(why)
        if position is not None:
            position = torch.tensor(position, dtype=torch.long, device=device)
        local = None if self.local_heads is None else self.local_heads.empty_cache(batch_size, self.dim_head, device,
                                                                                   dtype)
        global_ = None
        if self.global_heads is not None and not self.receives_context:
            global_ = self.global_heads.empty_cache(batch_size, device, dtype)
        return AttentionCache(position, local, global_, None)

    def check_place(self, place, length, parallel=False):
        """Raise ValueError naming what this layer cannot do at ``place`` (``place.py``) for x
        of ``length`` tokens (one rank's slice when ``parallel``)."""
        if place.cached:
            if (why := self.cache_refusal) is not None:
                raise ValueError(why)
            if place.row_starts is not None and self.blindspot_blocks:
                raise ValueError(LEFT_PADDED_BLOCKS.format(self.global_heads.blindspot_size))
        if place.segments is not None and self.receives_context:
            raise ValueError("segment_ids is not supported in a cross-attention layer (receives_context=True)")
        if place.segments is not None and isinstance(self.local_heads, WindowLinearHeads):
            raise ValueError("segment_ids is not supported with local_attn_older_keys='linear' yet: run the "
                             "sequences as rows of a batch")
        if not parallel:
            return
        if self.receives_context:
            raise ValueError("context_parallel is not supported with a cross-attention layer (receives_context=True) yet")
        for heads in self.head_kinds:
            if heads is not None:
                heads.check_slice(length)


# what a cache refuses for rows padded on the left when blind-spot blocks are on
LEFT_PADDED_BLOCKS = ("blindspot_size={} with rows padded on the left (input_mask) in a cache: each row's blocks would "
                      "start at another column; run the rows apart, pad on the right, or use blindspot_size=1")


def _check_inputs(layer, x, input_mask, context, context_mask, rotary):
    """Refuse the arguments of a layer's own forward that this kind of layer would not read (never
    ignore one), and a context or rotary tables of the wrong shape."""
    if layer.receives_context:
        for name, value in (("input_mask", input_mask), ("rotary", rotary)):
            if value is not None:
                raise ValueError(f"{name} is not read by a cross-attention layer (receives_context=True): its keys "
                                 "come from the context (mask them with context_mask), with no positions shared "
                                 "with the queries")
    refuse_unread_context(layer.receives_context, context, context_mask, "layer")
    if context is not None:
        check_context(context, context_mask, x.shape[0], layer.dim)
    if input_mask is not None:
        check_mask(input_mask, *x.shape[:2], "input_mask")
    if rotary is not None:
        dh, dqk = layer.dim_head, layer.dim_qk
        width = dh if dqk == dh else dh + dqk
        if rotary[0].shape[-1] != width:
            raise ValueError(f"rotary tables must have {width} features per position ("
                             + ("dim_head" if dqk == dh else "dim_head + dim_qk") + f"), got {rotary[0].shape[-1]}")
        if dqk != dh and dqk % 2:
            raise ValueError(f"rotary embeddings need an even dim_qk, got {dqk}")


def check_context(context, context_mask, batch, dim):
    """ValueError unless ``context`` is (batch, m, dim) and ``context_mask`` None or (batch, m) bool."""
    if context.ndim != 3 or context.shape[-1] != dim or context.shape[0] != batch:
        raise ValueError(f"context must have shape ({batch}, ctx_len, {dim}), got {tuple(context.shape)}")
    check_mask(context_mask, *context.shape[:2], "context_mask")


def _moved_parameters(state_dict, prefix, *args):
    """A state dict of a layer whose gates, convolution and writing strengths sat on the layer
    itself loads into their owner, the global heads."""
    for name in [key for key in state_dict if key.startswith(prefix)]:
        rest = name[len(prefix):]
        if rest.split(".", 1)[0] in ("forget_gate", "local_conv", "to_beta"):
            state_dict[prefix + "global_heads." + rest] = state_dict.pop(name)


def _check_older_keys(older_keys, feature_dim, sinks, n_local, causal, exact):
    """Check what the local heads do with the keys older than their window."""
    if older_keys not in (None, "linear"):
        raise ValueError(f"local_attn_older_keys must be None (unseen) or 'linear', got {older_keys!r}")
    if older_keys is None:
        for name, value in (("local_attn_feature_dim", feature_dim), ("local_attn_sinks", sinks)):
            if value is not None:
                raise ValueError(f"{name} is a setting of local_attn_older_keys='linear'")
        return
    if sinks is not None:
        check_int("local_attn_sinks", sinks, minimum=0)
    if not n_local:
        raise ValueError("local_attn_older_keys is a setting of local heads, and n_local_attn_heads is 0")
    if not causal or not exact:
        raise ValueError("local_attn_older_keys='linear' reads the keys before a sliding window: it needs causal=True "
                         "and local_attn_exact_windowsize=True")
    if feature_dim is not None:
        check_int("local_attn_feature_dim", feature_dim)


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


def split_heads(t, heads):
    """(b, n, heads * d) -> (b, heads, n, d)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


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
