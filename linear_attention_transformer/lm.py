"""The language model: token and position embeddings around a ``LinearAttentionTransformer``.

One forward serves training, prefill and decoding. Given a cache, x holds the tokens that
continue the cached sequence. One token per row while no gradient is recorded is a step
(``Place.step``): each stateful layer takes its recurrent form inside its own forward and
writes its entry of the cache in place. The position is the cache's one count, a tensor on the
model's device advanced in place. A step reads it back only eagerly on a CPU, where that costs
no wait, and as a tensor elsewhere: a compiled forward of one token (``torch.compile(model,
fullgraph=True)``) traces one graph for every position (on CUDA with
``mode="reduce-overhead"`` a CUDA graph, ``DecodingCache.static_tensors`` at static
addresses), and the step exports (``export.py``). A model with axial attention
(``attend_axially``) steps that layer on its cached path: eager only.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import HEADS, LOCAL_WINDOW_SIZE
from .normalization import make_norm
from .ops.common import check_int
from .ops.segments import INTEGER_DTYPES, check_integer_ids
from .positional import AbsolutePositionalEmbedding, AxialPositionalEmbedding
from .transformer import LinearAttentionTransformer, keyword_names, refuse_unknown_keywords


def check_token_ids(tokens, num_tokens, name):
    """ValueError naming ``name`` unless every id lies in [0, num_tokens): one min/max reduction
    and one host sync, instead of the embedding's IndexError about its own index."""
    low, high = (int(t) for t in torch.aminmax(tokens.long()))  # (no aminmax for every integer dtype)
    if low < 0 or high >= num_tokens:
        raise ValueError(f"{name} holds token ids from {low} to {high}; valid ids are 0 to {num_tokens - 1} "
                         f"(num_tokens={num_tokens})")


class LinearAttentionTransformerLM(nn.Module):
    """Token model: embeddings -> ``LinearAttentionTransformer`` -> logits (options: docs/layers.md).

    Args:
        num_tokens: vocabulary size. dim: model width. depth, max_seq_len, heads: as in
            ``LinearAttentionTransformer``.
        emb_dim: embedding width (default dim): tokens are embedded in emb_dim and projected up
            to ``dim``, and the logits read through dim -> emb_dim -> num_tokens, so no
            (num_tokens x dim) matrix exists when emb_dim < dim.
        tie_embedding: the output projection's weight is the token embedding matrix (one
            tensor, trained by both uses; the output keeps its own bias unless ``bias=False``).
        norm, norm_eps, bias: as in ``LinearAttentionTransformer``; the final normalisation is
            ``norm`` too, and ``bias=False`` also drops the biases of the output layer and of
            the emb_dim projections (a Llama-style model: ``norm='rmsnorm', bias=False,
            ff_glu=True, ff_activation='silu', use_rotary_emb=True``).
        return_embeddings: return the final hidden states (b, n, dim) instead of logits.
        use_axial_pos_emb: axial position embedding (the default unless use_rotary_emb) of
            shape (ceil(max_seq_len / w), w), w = local_attn_window_size.
        use_rotary_emb: rotary embeddings in attention instead (not with use_axial_pos_emb).
            With both off, a learned absolute embedding is added.
        use_pos_emb: False: no position information at all (neither of the above); order then
            comes from causality, the gates, the convolution, token shift and the local heads'
            windows (refused for a non-causal model without use_local_conv or shift_tokens).
        max_seq_len: the training length. An axial or absolute table holds max_seq_len
            positions, and the model refuses longer sequences (``length_limit``); with rotary or
            no positions it reads any length, and its cache streams without end.
        **kwargs: every other ``LinearAttentionTransformer`` option.
    Attributes: ``options``, every keyword the model was built with (its defaults included):
        ``LinearAttentionTransformerLM(**model.options)`` builds another like it.
    Shapes:
        x (b, n) integer tokens, n <= ``length_limit``; input_mask (b, n) bool; context
        (b, m, dim) and context_mask (b, m) for a decoder; segment_ids (b, n) integer for
        packed sequences. Returns logits (b, n, num_tokens), or (b, n, dim) with
        return_embeddings. Parameters: token_emb (num_tokens, emb_dim), project_in (dim,
        emb_dim), project_out (emb_dim, dim), to_logits (num_tokens, emb_dim) (the projections
        are Identity when emb_dim == dim).
    """

    def __init__(
        self, num_tokens, dim, depth, max_seq_len, heads=HEADS, emb_dim=None, tie_embedding=False,
        return_embeddings=False, use_axial_pos_emb=None, use_rotary_emb=False, use_pos_emb=True, norm="layernorm",
        norm_eps=1e-5, bias=True, _keywords_checked=False, **kwargs
    ):
        given = {name: value for name, value in locals().items() if name not in ("self", "kwargs", "_keywords_checked",
                                                                                    "__class__")}
        super().__init__()
        if not _keywords_checked:
            refuse_unknown_keywords(type(self).__name__, kwargs, self.option_names())
        self.options = {**given, **kwargs}  # (what rebuilds this model: ``LinearAttentionTransformerLM(**options)``)
        check_int("num_tokens", num_tokens)
        emb_dim = dim if emb_dim is None else emb_dim
        check_int("emb_dim", emb_dim)
        if not isinstance(tie_embedding, bool):
            raise TypeError(f"tie_embedding must be True or False, got {tie_embedding!r}")
        if tie_embedding and return_embeddings:
            raise ValueError("tie_embedding=True ties the output projection, which return_embeddings=True does not have")
        self.num_tokens, self.max_seq_len = num_tokens, max_seq_len
        self.token_emb = nn.Embedding(num_tokens, emb_dim)
        nn.init.normal_(self.token_emb.weight, std=0.02)
        if use_rotary_emb and use_axial_pos_emb:
            raise ValueError("use_axial_pos_emb and use_rotary_emb are two position schemes: choose one")
        if not isinstance(use_pos_emb, bool):
            raise TypeError(f"use_pos_emb must be True or False, got {use_pos_emb!r}")
        if not use_pos_emb:
            if use_rotary_emb or use_axial_pos_emb:
                raise ValueError("use_pos_emb=False means no position embedding: leave use_rotary_emb and "
                                 "use_axial_pos_emb unset")
            if not kwargs.get("causal", False) and not (kwargs.get("use_local_conv") or kwargs.get("shift_tokens")):
                raise ValueError("use_pos_emb=False: a non-causal model without use_local_conv or shift_tokens has "
                                 "nothing that tells one position from another")
        window = kwargs.pop("local_attn_window_size", None)
        transformer_uses_window = LinearAttentionTransformer.uses_local_window(kwargs.get("n_local_attn_heads", 0),
                                                                               kwargs.get("attend_axially", False))
        if transformer_uses_window:
            kwargs["local_attn_window_size"] = window
        axial = use_pos_emb and not use_rotary_emb and (use_axial_pos_emb is None or use_axial_pos_emb)  # None: default
        if window is not None and not (transformer_uses_window or axial):
            raise ValueError("local_attn_window_size shapes local heads, attend_axially and the axial position "
                             "embedding: this model has none of them")
        if use_rotary_emb or not use_pos_emb:
            self.pos_emb = None
        elif axial:
            self.pos_emb = AxialPositionalEmbedding(emb_dim, max_seq_len, LOCAL_WINDOW_SIZE if window is None else window)
        else:
            self.pos_emb = AbsolutePositionalEmbedding(emb_dim, max_seq_len)
        self.project_in = nn.Linear(emb_dim, dim, bias=bias) if emb_dim != dim else nn.Identity()
        self.transformer = LinearAttentionTransformer(dim, depth, max_seq_len, heads=heads, use_rotary_emb=use_rotary_emb,
                                                      norm=norm, norm_eps=norm_eps, bias=bias, _keywords_checked=True,
                                                      **kwargs)
        if self.pos_emb is not None:
            self.transformer.limit_length(f"the length of the {'axial' if axial else 'absolute'} position table "
                                          "(use_rotary_emb=True or use_pos_emb=False read any length)")
        self.norm = make_norm(norm, dim, norm_eps)
        self.return_embeddings = return_embeddings
        self.project_out = self.to_logits = None
        if not return_embeddings:
            self.project_out = nn.Linear(dim, emb_dim, bias=bias) if emb_dim != dim else nn.Identity()
            self.to_logits = nn.Linear(emb_dim, num_tokens, bias=bias)
            if tie_embedding:  # one Parameter in two modules: state_dict round trips keep it shared
                self.to_logits.weight = self.token_emb.weight

    @classmethod
    def option_names(cls):
        """Every keyword the constructor accepts: its own and ``LinearAttentionTransformer``'s."""
        return keyword_names(cls) | LinearAttentionTransformer.option_names()

    @property
    def length_limit(self):
        """The longest sequence the model reads: ``max_seq_len`` with a position table or
        Linformer, else None (any length; the cache streams without end)."""
        return self.transformer.length_limit

    @property
    def step_compiles(self):
        """Whether the one-token forward compiles as one graph (not with attend_axially)."""
        return not self.transformer.attend_axially

    @property
    def supports_cache(self):
        """Whether ``forward(..., return_cache=True)`` works: causal models without Linformer."""
        return self.transformer.supports_cache

    def forward(self, x, input_mask=None, context=None, context_mask=None, cache=None, return_cache=False,
                segment_ids=None, context_parallel=None):
        """Logits (b, n, num_tokens) (or embeddings). With ``return_cache=True`` returns
        (logits, cache): a ``DecodingCache`` holding the state after the last token of x, used
        as docs/training.md ("The cache") says: given ``cache``, x (and ``input_mask``) hold
        only the new tokens that continue that sequence, and the cache is updated in place
        (without ``return_cache``, a copy is). Rows padded on the left (``input_mask``) count
        positions from their first real token. ``segment_ids`` and ``context_parallel`` (x (b,
        n_local): this rank's slice) as in ``LinearAttentionTransformer.forward``.

        One token per row (x (b, 1)) with a cache, while no gradient is recorded (``no_grad``,
        ``inference_mode``), is the decoding step: the same numbers through each layer's
        recurrent form."""
        out = self._body(x, input_mask, context, context_mask, cache, return_cache, segment_ids, context_parallel)
        if not return_cache:
            return self._output(out)
        out, cache = out
        return self._output(out), cache

    def empty_cache(self, batch_size, device=None, dtype=None):
        """The ``DecodingCache`` of ``batch_size`` rows before any token (``forward``'s cache at
        position 0), on the parameters' device and in their dtype unless given."""
        parameter = self.token_emb.weight
        device = parameter.device if device is None else device
        return self.transformer.empty_cache(batch_size, device, parameter.dtype if dtype is None else dtype)

    def output_features(self, x, input_mask=None, context=None, context_mask=None, segment_ids=None,
                        context_parallel=None):
        """What the logits are read from: (b, n, emb_dim), with ``forward(x, ...) ==
        output_layer(output_features(x, ...))`` (``AutoregressiveWrapper``'s chunked loss)."""
        if self.return_embeddings:
            raise ValueError("a model with return_embeddings=True has no output layer")
        out = self._body(x, input_mask, context, context_mask, None, False, segment_ids, context_parallel)
        return self.project_out(self.norm(out))

    def continue_features(self, x, cache):
        """(features, cache): ``forward(x, cache=cache, return_cache=True)`` without the output
        layer, whose logits ``logits_of(features)`` gives (a server computes logits only where
        it samples)."""
        return self._body(x, None, None, None, cache, True)

    def logits_of(self, features):
        """The logits of ``continue_features``' features."""
        return self._output(features)

    @property
    def output_layer(self):
        """The last Linear(emb_dim, num_tokens) (None with return_embeddings)."""
        return self.to_logits

    def _body(self, x, input_mask, context, context_mask, cache, return_cache, segment_ids=None,
              context_parallel=None):
        """The final hidden states, the call's inputs checked once, here (``place_of``). Ids
        outside the vocabulary raise ``check_token_ids``' ValueError on every device: on the CPU
        it looks only once the embedding has failed (valid ids cost nothing); elsewhere, where the
        embedding would fail on the device (CUDA: a device-side assert, and the process loses
        its CUDA context), it looks first, with one reduction and one host sync per forward.
        Not inside torch.compile: a compiled model's caller checks its ids."""
        if not torch.is_tensor(x) or x.dtype not in INTEGER_DTYPES:
            check_integer_ids(x, "x")
        if x.ndim != 2 or x.shape[1] < 1:
            raise ValueError(f"x must have shape (batch, seq_len) with at least one token, got {tuple(x.shape)}")
        transformer = self.transformer
        place = transformer.place_of(x, input_mask, context, context_mask, cache, return_cache, segment_ids,
                                     context_parallel)
        if x.device.type != "cpu" and not torch.compiler.is_compiling():
            check_token_ids(x, self.num_tokens, "x")
        try:  # (ids of any integer dtype: the embedding takes int64)
            h = self.token_emb(x if x.dtype == torch.int64 else x.long())
        except IndexError:
            check_token_ids(x, self.num_tokens, "x")
            raise
        positions = None
        if self.pos_emb is not None or transformer.rotary is not None:
            positions = place.positions(x.shape[1], x.device)
        if self.pos_emb is not None:
            embedded = self.pos_emb(positions)
            h = h + (embedded if embedded.dtype == h.dtype else embedded.to(h.dtype))
        if cache is not None and not return_cache:  # (a call that only reads a cache leaves it as it was)
            cache = cache.clone()
        if not isinstance(self.project_in, nn.Identity):
            h = self.project_in(h)
        out = transformer.attend(h, place, input_mask, context, context_mask, cache, positions)
        return out[0] if place.cached and not return_cache else out

    def _output(self, out):
        """The logits (or the normalised embeddings) of the final hidden states."""
        out = self.norm(out)
        if self.return_embeddings:
            return out
        return self.to_logits(self.project_out(out))
