"""The transformer: a stack of (attention, feed-forward) residual pairs.

Each layer is one pair (f, g): x <- x + f(x), x <- x + g(x) (or the reversible form of the
same pair). A decoder adds a (context attention, feed-forward) pair per layer, and
``attend_axially`` adds an (axial attention, feed-forward) pair. Every branch normalises
its input first and may shift tokens (``token_shift.py``).
"""

from __future__ import annotations

import difflib
import inspect
from functools import partial
from typing import Optional

import torch
from einops import rearrange
from product_key_memory import PKM
from torch import nn

from .attention import (HEADS, LEFT_PADDED_BLOCKS, LOCAL_WINDOW_SIZE, Attention, check_context, pad_to_multiple,
                        refuse_unread_context, resolve_dim_qk, resolve_heads)
from .cache import AxialCache, BranchCache, DecodingCache, copy_rows, map_tensors
from .context_parallel import exchange_boundaries
from .feedforward import FeedForward
from .linformer import LinformerContextSettings, LinformerSettings, linformer_layers
from .normalization import check_norm, make_norm
from .ops.common import check_int, check_mask
from .place import PLAIN, Place
from .positional import RotaryEmbedding
from .reversible import ReversibleSequence, SequentialSequence
from .token_shift import shift_tokens, token_shifts


class Branch(nn.Module):
    """One residual branch: a normalisation, optional token shift, then ``fn``.

    Args:
        dim: width. fn: the module. shifts: token shifts or None. dropout: on fn's output.
        norm: the normalisation module (default ``nn.LayerNorm(dim)``).
        reads: the model's inputs besides x that ``fn`` takes (self-attention: input_mask;
            cross-attention: context and context_mask; a feed-forward: none). A module with a
            sequence of its own (``Attention``, ``FoldAxially``) also reads the ``Place``.
    x (b, n, dim) -> (b, n, dim).
    """

    def __init__(self, dim, fn, shifts=None, reads=(), dropout=0.0, norm=None):
        super().__init__()
        self.dim = dim
        self.norm = nn.LayerNorm(dim) if norm is None else norm
        self.fn, self.shifts, self.reads = fn, shifts, tuple(reads)
        self.dropout = nn.Dropout(dropout)
        self.stateful = isinstance(fn, (Attention, FoldAxially))  # (it reads the place, and has a cache)

    def empty_cache(self, batch_size, device=None, dtype=torch.float32):
        """The ``BranchCache`` before any token: a zero previous token to shift in, and the
        module's empty cache (None for a module without state)."""
        shift = None if self.shifts is None else torch.zeros(batch_size, self.dim, device=device,
                                                             dtype=dtype)
        return BranchCache(shift, self.fn.empty_cache(batch_size, device, dtype) if self.stateful else None)

    def forward(self, x, place=PLAIN, cache=None, **inputs):
        """The branch's output at ``place``; with ``place.cached``, ``cache`` (``empty_cache`` at
        a sequence's start) continues a sequence and is updated in place."""
        h = self.norm(x)
        if self.shifts is not None and place.group is not None:
            h = _shift_tokens_context_parallel(h, self.shifts, inputs.get("input_mask"), place.group)
        elif self.shifts is not None:
            shift = None if cache is None else cache.shift  # (the token the next call's first token shifts in)
            h = shift_tokens(h, self.shifts, inputs.get("input_mask"), previous=shift, segments=place.segments,
                             keep=shift)
        if self.stateful:
            out = self.fn.attend(h, place, cache=None if cache is None else cache.fn, **inputs)
        elif self.reads:
            out = self.fn(h, **{name: inputs.get(name) for name in self.reads})
        else:
            out = self.fn(h)
        return self.dropout(out) if self.training else out


def _shift_tokens_context_parallel(h, shifts, mask, group):
    """``shift_tokens`` across the slice's ends: the neighbours' boundary tokens (masked ones
    zeroed) extend the slice, zeros at the sequence's ends as without a split."""
    if mask is not None:
        h = h.masked_fill(~mask[..., None], 0.0)
    before, after = max(max(shifts), 0), max(-min(shifts), 0)
    ((previous, following),) = exchange_boundaries([(h, 1)], group, before, after)
    n = h.shape[1]
    return shift_tokens(torch.cat((previous, h, following), dim=1), shifts)[:, before : before + n]


class FoldAxially(nn.Module):
    """Attention along the strided axis: positions t with the same t mod w form one sequence.
    x (b, n, dim) -> (b, n, dim); n is padded to a multiple of w internally.

    Decoding keeps one state per residue class: an inner cache over b * w rows."""

    def __init__(self, width, attn):
        super().__init__()
        check_int("local_attn_window_size (the stride of attend_axially)", width)
        self.width, self.attn = width, attn

    def forward(self, x, input_mask=None):
        return self.attend(x, PLAIN, input_mask)

    def empty_cache(self, batch_size, device=None, dtype=torch.float32):
        return AxialCache(self.attn.empty_cache(batch_size * self.width, device, dtype))

    def attend(self, x, place=PLAIN, input_mask=None, cache=None, context=None, context_mask=None):
        """The output at ``place`` (plain or cached: the model refuses the others);
        ``cache``: an ``AxialCache`` when ``place.cached``, updated in place. Eager only when
        cached: the rows it continues follow the position, read on the host. (A decoder's
        ``context`` is not read by its axial layers.)"""
        if place.cached:
            return self._cached(x, input_mask, cache, int(place.start))
        b, n, _ = x.shape
        if n % self.width and (input_mask is not None or not self.attn.causal):
            input_mask = torch.ones(b, n, dtype=torch.bool, device=x.device) if input_mask is None else input_mask
            input_mask = pad_to_multiple(input_mask, self.width, dim=1, value=False)
        x = pad_to_multiple(x, self.width, dim=1)
        x = rearrange(x, "b (i w) d -> (b w) i d", w=self.width)
        if input_mask is not None:
            input_mask = rearrange(input_mask, "b (i w) -> (b w) i", w=self.width)
        out = self.attn(x, input_mask=input_mask)
        return rearrange(out, "(b w) i d -> b (i w) d", b=b)[:, :n]

    def _cached(self, x, input_mask, cache, position):
        b, n, _ = x.shape
        w = self.width
        inner = cache.inner

        def one(t):
            return self._one_token(x[:, t : t + 1], _cut(input_mask, t, t + 1), inner, position + t)

        # whole rounds of w tokens, aligned to the residue classes, go through the folded
        # chunked form at once; the tokens before and after them one at a time
        head = min(n, -position % w)
        full = (n - head) // w * w
        outs = [one(t) for t in range(head)]
        if full:
            xs = rearrange(x[:, head : head + full], "b (i w) d -> (b w) i d", w=w)
            ms = _cut(input_mask, head, head + full)
            ms = None if ms is None else rearrange(ms, "b (i w) -> (b w) i", w=w)
            out = self.attn.attend(xs, Place((position + head) // w, True), ms, inner)
            outs.append(rearrange(out, "(b w) i d -> b (i w) d", b=b))
        outs += [one(t) for t in range(head + full, n)]
        return torch.cat(outs, dim=1)

    def _one_token(self, x, mask, inner, position):
        """One token at absolute ``position``: it continues the rows of residue position mod w,
        the (position // w)-th token of theirs (their buffers updated in place)."""
        b = x.shape[0]
        rows = torch.arange(b, device=x.device) * self.width + position % self.width
        sub = map_tensors(inner, lambda t: t.index_select(0, rows))
        out = self.attn.attend(x, Place(position // self.width, True), mask, sub)
        copy_rows(inner, rows, sub)
        return out


def _cut(mask, start, stop):
    return None if mask is None else mask[:, start:stop]


class ProductKeyMemory(nn.Module):
    """product_key_memory.PKM as a feed-forward replacement. x (b, n, dim) -> (b, n, dim).
    Each query picks its top min(32, num_keys) keys per half (PKM's default is 32)."""

    def __init__(self, dim, num_keys):
        super().__init__()
        check_int("pkm_num_keys", num_keys)
        self.pkm = PKM(dim, num_keys=num_keys, topk=min(32, num_keys))

    def forward(self, x):
        return self.pkm(x)


def keyword_names(factory):
    """The keywords ``factory`` takes by name; a private one (``_keywords_checked``) is no option."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name for name, p in inspect.signature(factory).parameters.items()
            if p.kind in kinds and not name.startswith("_")}


# Attention options about a layer's own sequence. The strided axial layers have no local heads
# or blindspot; a cross-attention layer (its keys come from a context) has none of these.
_LOCAL_OPTIONS = frozenset({"n_local_attn_heads", "blindspot_size"}) | {
    name for name in keyword_names(Attention) if name.startswith("local_attn_") and name != "local_attn_window_size"
}
_SEQUENCE_OPTIONS = _LOCAL_OPTIONS | {"chunk_size", "kernel", "use_local_conv", "local_conv_kernel", "update_rule"}
# what the model itself decides for every attention layer: not options to hand over
_SET_BY_MODEL = frozenset({"dim", "heads", "dim_head", "causal", "receives_context", "local_attn_window_size", "dropout",
                           "bias"})


def refuse_unknown_keywords(owner, given, known):
    """TypeError naming the class the user called and each keyword of ``given`` not in ``known``,
    with the closest valid name as a suggestion. Called once per model, by the constructor the
    user called; a model built by another (the LM's stack, ``compat``, ``hf``) is handed
    ``_keywords_checked=True``."""
    unknown = [name for name in given if name not in known]
    if not unknown:
        return

    def described(name):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        return repr(name) + (f" (did you mean {close[0]!r}?)" if close else "")

    what = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments:"
    raise TypeError(f"{owner} got {what} {', '.join(map(described, unknown))}")


class _AttentionOptions:
    """The attention keywords a model was given. Each layer kind takes those it honours (its
    constructor's own keywords, so no list is written twice); what no layer took is refused."""

    def __init__(self, options):
        self.given, self.taken, self.kinds = dict(options), set(), []

    def take(self, kind, factory, excluded=frozenset()):
        names = keyword_names(factory) - _SET_BY_MODEL - set(excluded)
        taken = {name: value for name, value in self.given.items() if name in names}
        self.taken |= taken.keys()
        self.kinds.append(kind)
        return taken

    @staticmethod
    def names():
        """Every attention option some layer kind takes."""
        return (keyword_names(Attention) | keyword_names(linformer_layers)) - _SET_BY_MODEL

    def check_all_taken(self):
        left = [name for name in self.given if name not in self.taken]
        if left:
            raise ValueError(
                f"{', '.join(left)}: no layer of this model can honour these options; its attention layers are "
                f"{', '.join(dict.fromkeys(self.kinds))} (Linformer layers take their own options from "
                "LinformerSettings; cross-attention has no local heads, blindspot, chunking or convolution)"
            )


class LinearAttentionTransformer(nn.Module):
    """A stack of linear-attention layers on continuous inputs (every option: docs/layers.md).

    Args:
        dim, depth: width and number of layers. max_seq_len: the training length; it limits the
            sequence only where something is sized by it (``length_limit``: Linformer's
            projections), so a model without Linformer reads, and streams through its cache,
            sequences of any length.
        heads, dim_head: heads of every attention layer and their size (default dim // heads);
            the attention option ``dim_qk`` sizes the global heads' queries and keys apart
            (``Attention``), rotary embeddings included.
        causal: each position sees only itself and the past.
        local_attn_window_size: w of the local heads, and the stride of ``attend_axially``
            (default ``attention.LOCAL_WINDOW_SIZE``); refused when the model has neither.
        attn_layer_dropout: dropout on each attention layer's output.
        reversible / checkpoint: reversible residual pairs, or gradient checkpointing
            (``reversible.py``); not both.
        receives_context: a cross-attention pair per layer (decoder); forward then needs ``context``.
        attend_axially: a strided global attention pair per layer, over positions that share
            t mod local_attn_window_size.
        pkm_layers: 1-based layers whose feed-forward is a product-key memory of ``pkm_num_keys``.
        linformer_settings / context_linformer_settings: Linformer self- / cross-attention.
        shift_tokens: shift a slice of the features by one token in every branch.
        use_rotary_emb: rotary position embeddings on queries and keys of self-attention;
            rotary_base: the base of their angles (default 10000).
        norm, norm_eps: the normalisation before each branch: 'layernorm' (default) or
            'rmsnorm' (``normalization.py``), with this eps.
        bias: biases on the attention layers' output projections and the feed-forwards'
            Linears (False: none, as Llama).
        ff_*: the ``FeedForward``'s options with the prefix (ff_mult, ff_hidden_dim, ff_activation,
            ff_glu, ff_dropout, ff_chunks).
        **attention_options: the attention layers' options (``Attention``'s, one
            n_local_attn_heads per layer allowed), each handed to the layer kinds that honour
            it. An unknown keyword raises TypeError; one that no layer can honour ValueError.
    Shapes:
        x (b, n, dim) (n <= max_seq_len with Linformer); input_mask (b, n) bool; context (b, m, dim);
        context_mask (b, m) bool; segment_ids (b, n) integer (packed sequences, see
        ``forward``). Returns (b, n, dim).
    """

    def __init__(
        self, dim, depth, max_seq_len, heads=HEADS, dim_head=None, causal=False, local_attn_window_size=None,
        attn_layer_dropout=0.0, reversible=False, checkpoint=False, receives_context=False, attend_axially=False,
        pkm_layers=(), pkm_num_keys=128, linformer_settings: Optional[LinformerSettings] = None,
        context_linformer_settings: Optional[LinformerContextSettings] = None, shift_tokens=False,
        use_rotary_emb=False, rotary_base=None, norm="layernorm", norm_eps=1e-5, bias=True, _keywords_checked=False,
        **options
    ):
        super().__init__()
        check_int("depth", depth)
        check_int("max_seq_len", max_seq_len)
        check_norm(norm, norm_eps)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        if rotary_base is not None:
            if not use_rotary_emb:
                raise ValueError("rotary_base is the base of the rotary embedding's angles: set use_rotary_emb=True")
            if isinstance(rotary_base, bool) or not isinstance(rotary_base, (int, float)) or not rotary_base > 1:
                raise ValueError(f"rotary_base must be a number above 1, got {rotary_base!r}")
        if linformer_settings is not None:
            if not isinstance(linformer_settings, LinformerSettings):
                raise TypeError("linformer_settings must be a LinformerSettings")
            if causal:
                raise ValueError("Linformer (linformer_settings) cannot be causal: it mixes all positions")
            if use_rotary_emb:
                raise ValueError("use_rotary_emb is not supported with linformer_settings")
            if attend_axially:
                raise ValueError("attend_axially is linear attention over strided positions: not with linformer_settings")
        if context_linformer_settings is not None and not isinstance(context_linformer_settings, LinformerContextSettings):
            raise TypeError("context_linformer_settings must be a LinformerContextSettings")
        if context_linformer_settings is not None and not receives_context:
            raise ValueError("context_linformer_settings needs receives_context=True")
        if reversible and checkpoint:
            raise ValueError("reversible=True and checkpoint=True are two ways to trade compute for memory: choose one")
        bad = [p for p in pkm_layers if not isinstance(p, int) or not 1 <= p <= depth]
        if bad:
            raise ValueError(f"pkm_layers holds 1-based layer numbers up to depth={depth}, got {bad}")

        self.dim, self.max_seq_len, self.causal = dim, max_seq_len, causal
        self.linformer = linformer_settings is not None
        # the longest sequence the model can read (None: any), and what sizes it
        self.length_limit, self.limited_by = None, None
        if self.linformer:
            self.limit_length("the length Linformer's projections are sized for")
        self.receives_context, self.attend_axially = receives_context, attend_axially
        shifts = token_shifts(causal) if shift_tokens else None
        if not _keywords_checked:
            refuse_unknown_keywords(type(self).__name__, options, self.option_names())
        ff_options = {name[3:]: options.pop(name) for name in list(options) if name.startswith("ff_")}
        options = _AttentionOptions(options)
        shared = dict(heads=heads, dim_head=dim_head, bias=bias)

        # each layer kind takes its options once, here
        if linformer_settings is None:
            linear = options.take("linear attention", Attention)
            local_heads = linear.pop("n_local_attn_heads", 0)
            if not isinstance(local_heads, (tuple, list)):
                local_heads = (local_heads,) * depth
            elif len(local_heads) != depth:
                raise ValueError(f"n_local_attn_heads as a tuple needs one entry per layer: {depth}, got {len(local_heads)}")
            window_options = [name for name in linear if name.startswith("local_attn_")]
            if window_options and not any(local_heads):
                raise ValueError(f"{', '.join(window_options)}: settings of local heads, and n_local_attn_heads is 0")
            self_attention = [
                Attention(dim, causal=causal, n_local_attn_heads=n, local_attn_window_size=local_attn_window_size if n else None,
                          **shared, **linear)
                for n in local_heads
            ]
        else:
            taken = options.take("Linformer self-attention", linformer_layers)
            self_attention = linformer_layers(linformer_settings, dim, max_seq_len, depth, **shared, **taken)
        if local_attn_window_size is not None and not self.uses_local_window(options.given.get("n_local_attn_heads", 0), attend_axially):
            raise ValueError(
                "local_attn_window_size is the window of local heads and the stride of attend_axially: "
                "this model has neither (n_local_attn_heads is 0, attend_axially is False)"
            )
        if attend_axially:
            axial_options = options.take("axial linear attention", Attention, _LOCAL_OPTIONS)
        if receives_context and context_linformer_settings is None:
            cross_options = options.take("linear cross-attention", Attention, _SEQUENCE_OPTIONS)
        elif receives_context:
            taken = options.take("Linformer cross-attention", linformer_layers)
            cross_attention = linformer_layers(context_linformer_settings, dim, None, depth, **shared, **taken)
        options.check_all_taken()

        def feedforward_branch(layer):
            if layer + 1 in pkm_layers:
                fn = ProductKeyMemory(dim, pkm_num_keys)
            else:
                fn = FeedForward(dim, bias=bias, **ff_options)
            return Branch(dim, fn, shifts, norm=make_norm(norm, dim, norm_eps))

        def attention_branch(fn, *reads, shifts=shifts):
            return Branch(dim, fn, shifts, reads, dropout=attn_layer_dropout, norm=make_norm(norm, dim, norm_eps))

        blocks = []
        for layer in range(depth):
            blocks.append((attention_branch(self_attention[layer], "input_mask"), feedforward_branch(layer)))

            if attend_axially:
                axial = Attention(dim, causal=causal, **shared, **axial_options)
                fold = FoldAxially(LOCAL_WINDOW_SIZE if local_attn_window_size is None else local_attn_window_size, axial)
                blocks.append((attention_branch(fold, "input_mask"), feedforward_branch(layer)))

            if receives_context:
                if context_linformer_settings is None:
                    cross = Attention(dim, receives_context=True, **shared, **cross_options)
                else:
                    cross = cross_attention[layer]
                # the context is fixed for the whole sequence: no token shift in this branch
                blocks.append((attention_branch(cross, "context", "context_mask", shifts=None), feedforward_branch(layer)))

        self.layers = ReversibleSequence(blocks) if reversible else SequentialSequence(blocks, checkpoint=checkpoint)
        # (a plain tuple, not registered again: what check_place walks on every cached call)
        self.attention_layers = tuple(m for m in self.layers.modules() if isinstance(m, Attention))
        # the blind spot of the layers that see keys by blocks (1: none does)
        self.blindspot_size = max([m.global_heads.blindspot_size for m in self.attention_layers if m.blindspot_blocks],
                                  default=1)
        if use_rotary_emb:
            dim_head = resolve_heads(dim, heads, dim_head)[0]
            self.rotary = RotaryEmbedding(dim_head, 10000 if rotary_base is None else rotary_base,
                                          dim_qk=resolve_dim_qk(options.given.get("dim_qk"), dim_head))
        else:
            self.rotary = None

    @classmethod
    def option_names(cls):
        """Every keyword the constructor accepts: its own, the feed-forward's (``ff_`` and a
        ``FeedForward`` keyword) and the attention layers' options."""
        feedforward = {"ff_" + name for name in keyword_names(FeedForward) - {"dim", "bias"}}
        return keyword_names(cls) | feedforward | _AttentionOptions.names()

    @staticmethod
    def uses_local_window(n_local_attn_heads=0, attend_axially=False):
        """Whether a model with these options has a use for ``local_attn_window_size``."""
        per_layer = n_local_attn_heads if isinstance(n_local_attn_heads, (tuple, list)) else (n_local_attn_heads,)
        return bool(attend_axially) or any(per_layer)

    def forward(self, x, input_mask=None, context=None, context_mask=None, positions=None, cache=None,
                return_cache=False, segment_ids=None, context_parallel=None):
        """x (b, n, dim) -> (b, n, dim). With ``return_cache`` -> (out, DecodingCache); given a
        ``cache``, x holds only the tokens that continue the cached sequence.

        ``segment_ids`` (b, n) integer: packed sequences (docs/packed.md): each segment's output
        equals that segment run alone, its rotary positions (unless ``positions``, (n,) or (b,
        n), is given) restarting at its first token. ``input_mask`` still marks padding.

        ``context_parallel``: a ``torch.distributed`` process group (or a ``ContextParallel``)
        over which one sequence is split, x (b, n_local, dim) and the output this rank's slice
        (docs/scale.md; ``positions``, if given, are the slice's). What the model cannot do with
        either (or a cache) raises ValueError before any communication (``place_of``).

        ``context`` / ``context_mask`` need ``receives_context=True``, and ``positions`` (the
        rotary embedding's) ``use_rotary_emb=True``: without them they raise ValueError."""
        if x.ndim != 3 or x.shape[-1] != self.dim or x.shape[1] < 1:
            raise ValueError(f"x must have shape (batch, seq_len >= 1, {self.dim}), got {tuple(x.shape)}")
        if positions is not None and self.rotary is None:
            raise ValueError("positions are the rotary embedding's, and this model was built without use_rotary_emb=True")
        place = self.place_of(x, input_mask, context, context_mask, cache, return_cache, segment_ids, context_parallel)
        if cache is not None and not return_cache:  # (a call that only reads a cache leaves it as it was)
            cache = cache.clone()
        out = self.attend(x, place, input_mask, context, context_mask, cache, positions)
        return out[0] if place.cached and not return_cache else out

    def place_of(self, x, input_mask=None, context=None, context_mask=None, cache=None, return_cache=False,
                 segment_ids=None, context_parallel=None):
        """Check a call's inputs once, where the call enters the model (``forward``, or the LM's),
        and return where x (b, n, …) sits (``place.py``). What the model cannot do there raises
        ValueError before any communication (``check_place``)."""
        if input_mask is not None:
            check_mask(input_mask, *x.shape[:2], "input_mask")
        if context is not None or context_mask is not None:
            refuse_unread_context(self.receives_context, context, context_mask, "model")
            if context is not None:
                check_context(context, context_mask, x.shape[0], self.dim)
        elif self.receives_context and cache is None:
            raise ValueError("this model has receives_context=True: pass context=(batch, ctx_len, dim)")
        if cache is not None and cache.rows() != x.shape[0]:
            raise ValueError(f"x must have one {'token' if x.shape[1] == 1 else 'row'} for each of the cache's "
                             f"{cache.rows()} rows, got {x.shape[0]}")
        place = Place.of(x, cache, return_cache, segment_ids, context_parallel, self.check_place, input_mask)
        if place.group is not None:
            group = place.group
            self.check_length(group.world_size * group.length, f" ({group.world_size} slices of {group.length})")
        return place

    def check_place(self, place, length, parallel=False):
        """Raise ValueError naming what this model cannot do at ``place`` for x of ``length``
        tokens (one rank's slice when ``parallel``), as ``Attention.check_place``."""
        if place.cached:
            if (why := self.cache_refusal) is not None:
                raise ValueError(why)
            if place.row_starts is not None and self.blindspot_size > 1:
                raise ValueError(LEFT_PADDED_BLOCKS.format(self.blindspot_size))
        if self.length_limit is not None and not parallel:
            if place.position is not None:
                if place.start + length > self.length_limit:
                    self.check_length(place.start + length)
            # a step that knows its position only on the device checks there, but in an exported graph
            # (the flag torch.export sets: torch 2.11's Dynamo reads is_exporting() as True in every compile)
            elif not torch.compiler._is_exporting_flag:
                torch._assert_async(place.tensor + length <= self.length_limit,
                                    f"sequence length exceeds max_seq_len={self.max_seq_len}, {self.limited_by}")
        if place.segments is None and not parallel:
            return
        whole = {"segment_ids": place.segments is not None, "context_parallel": parallel}
        for option in (name for name, given in whole.items() if given):
            for refused, what in ((self.linformer, "Linformer self-attention (linformer_settings) projects the whole "
                                   "sequence at once"),
                                  (self.attend_axially, "attend_axially mixes positions across the whole row"),
                                  (self.receives_context, "cross-attention (receives_context) reads one context per "
                                   "row")):
                if refused:
                    raise ValueError(f"{option} is not supported here: {what}")
        for module in self.attention_layers:  # (what a layer refuses depends on the slice's length)
            module.check_place(place, length, parallel)

    def attend(self, x, place=PLAIN, input_mask=None, context=None, context_mask=None, cache=None, positions=None):
        """The layers at ``place`` (``place_of``), the inputs checked there -> out, or with
        ``place.cached`` (out, DecodingCache): ``cache`` (made when None) updated in place.
        ``positions``: the rotary embedding's (default ``place.positions``)."""
        if self.rotary is not None:
            place = place.but(rotary=self.rotary(place.positions(x.shape[1], x.device) if positions is None
                                                 else positions))
        inputs = dict(input_mask=input_mask, context=context, context_mask=context_mask)
        if not place.cached:
            return self.layers(x, place=place, **inputs)
        if cache is None:
            cache = self.empty_cache(x.shape[0], x.device, x.dtype)
        cache.row_starts = place.row_starts  # (a row without a real token yet moves its start on)
        # each branch continues its own entry of the cache (updated in place), composed by the
        # stack's own rule (reversible.py)
        pairs = []
        for (f, g), (cf, cg) in zip(self.layers.blocks, cache.layers):
            pairs.append((partial(f.forward, place=place, cache=cf, **inputs),
                          partial(g.forward, place=place, cache=cg, **inputs)))
        out = self.layers.compose(x, pairs)
        cache.position.add_(x.shape[1])
        return out, cache

    def empty_cache(self, batch_size, device=None, dtype=torch.float32):
        """The ``DecodingCache`` before any token: every layer's empty state (zero sums, no
        keys in the rings, zero convolution and shift inputs) at position 0."""
        if (why := self.cache_refusal) is not None:
            raise ValueError(why)
        layers = [[branch.empty_cache(batch_size, device, dtype) for branch in pair] for pair in self.layers.blocks]
        return DecodingCache(torch.zeros((), dtype=torch.long, device=device), layers)

    def limit_length(self, limited_by):
        """Make ``max_seq_len`` the longest sequence the model reads; ``limited_by`` says what
        is sized by it (a position table, Linformer's projections), for the error."""
        self.length_limit, self.limited_by = self.max_seq_len, limited_by

    def check_length(self, length, detail=""):
        """ValueError when a sequence of ``length`` tokens is longer than ``length_limit``."""
        if self.length_limit is not None and length > self.length_limit:
            raise ValueError(f"sequence length {length}{detail} exceeds max_seq_len={self.max_seq_len}, "
                             f"{self.limited_by}")

    @property
    def supports_cache(self):
        return self.causal and not self.linformer

    @property
    def cache_refusal(self):
        """Why this model cannot decode with a cache (a sentence), or None: what the cache, the
        exported step, the slots and vLLM all refuse."""
        if self.linformer:
            return "Linformer self-attention (linformer_settings) has no recurrent form: no cache"
        if not self.causal:
            return "cached decoding needs a causal model (causal=True), and this one has causal=False"
        if self.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.modules()):
            return "cached decoding needs eval mode: dropout is active (call model.eval())"
        return None
