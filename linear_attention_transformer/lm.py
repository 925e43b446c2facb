"""The language model: token and position embeddings around a ``LinearAttentionTransformer``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import HEADS, LOCAL_WINDOW_SIZE
from .decoding import Decoder
from .ops.common import _check_int
from .ops.segments import check_integer_ids
from .place import Place
from .positional import AbsolutePositionalEmbedding, AxialPositionalEmbedding
from .transformer import LinearAttentionTransformer, _parameters, refuse_unknown_keywords


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
            tensor, trained by both uses; the output keeps its own bias).
        return_embeddings: return the final hidden states (b, n, dim) instead of logits.
        use_axial_pos_emb: axial position embedding (the default unless use_rotary_emb) of
            shape (ceil(max_seq_len / w), w), w = local_attn_window_size.
        use_rotary_emb: rotary embeddings in attention instead (not with use_axial_pos_emb).
            With both off, a learned absolute embedding is added.
        **kwargs: every other ``LinearAttentionTransformer`` option.
    Shapes:
        x (b, n) integer tokens, n <= max_seq_len; input_mask (b, n) bool; context
        (b, m, dim) and context_mask (b, m) for a decoder; segment_ids (b, n) integer for
        packed sequences. Returns logits (b, n, num_tokens), or (b, n, dim) with
        return_embeddings. Parameters: token_emb (num_tokens, emb_dim), project_in (dim,
        emb_dim), project_out (emb_dim, dim), to_logits (num_tokens, emb_dim) (the projections
        are Identity when emb_dim == dim).
    """

    def __init__(
        self, num_tokens, dim, depth, max_seq_len, heads=HEADS, emb_dim=None, tie_embedding=False,
        return_embeddings=False, use_axial_pos_emb=None, use_rotary_emb=False, **kwargs
    ):
        super().__init__()
        refuse_unknown_keywords(type(self).__name__, kwargs, self.option_names())
        _check_int("num_tokens", num_tokens)
        emb_dim = dim if emb_dim is None else emb_dim
        _check_int("emb_dim", emb_dim)
        if not isinstance(tie_embedding, bool):
            raise TypeError(f"tie_embedding must be True or False, got {tie_embedding!r}")
        if tie_embedding and return_embeddings:
            raise ValueError("tie_embedding=True ties the output projection, which return_embeddings=True does not have")
        self.num_tokens, self.max_seq_len = num_tokens, max_seq_len
        self.token_emb = nn.Embedding(num_tokens, emb_dim)
        nn.init.normal_(self.token_emb.weight, std=0.02)
        if use_rotary_emb and use_axial_pos_emb:
            raise ValueError("use_axial_pos_emb and use_rotary_emb are two position schemes: choose one")
        window = kwargs.pop("local_attn_window_size", None)
        transformer_uses_window = LinearAttentionTransformer.uses_local_window(kwargs.get("n_local_attn_heads", 0),
                                                                               kwargs.get("attend_axially", False))
        if transformer_uses_window:
            kwargs["local_attn_window_size"] = window
        axial = not use_rotary_emb and (use_axial_pos_emb is None or use_axial_pos_emb)  # None: the default, axial
        if window is not None and not (transformer_uses_window or axial):
            raise ValueError("local_attn_window_size shapes local heads, attend_axially and the axial position "
                             "embedding: this model has none of them")
        if use_rotary_emb:
            self.pos_emb = None
        elif axial:
            self.pos_emb = AxialPositionalEmbedding(emb_dim, max_seq_len, LOCAL_WINDOW_SIZE if window is None else window)
        else:
            self.pos_emb = AbsolutePositionalEmbedding(emb_dim, max_seq_len)
        self.project_in = nn.Linear(emb_dim, dim) if emb_dim != dim else nn.Identity()
        self.transformer = LinearAttentionTransformer(dim, depth, max_seq_len, heads=heads,
                                                      use_rotary_emb=use_rotary_emb, **kwargs)
        self.norm = nn.LayerNorm(dim)
        self.return_embeddings = return_embeddings
        self.project_out = self.to_logits = None
        if not return_embeddings:
            self.project_out = nn.Linear(dim, emb_dim) if emb_dim != dim else nn.Identity()
            self.to_logits = nn.Linear(emb_dim, num_tokens)
            if tie_embedding:  # one Parameter in two modules: state_dict round trips keep it shared
                self.to_logits.weight = self.token_emb.weight

    @classmethod
    def option_names(cls):
        """Every keyword the constructor accepts: its own and ``LinearAttentionTransformer``'s."""
        return _parameters(cls) | LinearAttentionTransformer.option_names()

    @property
    def supports_cache(self):
        """Whether ``forward(..., return_cache=True)`` works: causal models without Linformer."""
        return self.transformer.supports_cache

    def forward(self, x, input_mask=None, context=None, context_mask=None, cache=None, return_cache=False,
                segment_ids=None, context_parallel=None):
        """Logits (b, n, num_tokens) (or embeddings). With ``return_cache=True`` returns
        (logits, cache): a ``DecodingCache`` holding the state after the last token of x, used
        as docs/training.md ("The cache") says: given ``cache``, x (and ``input_mask``) hold
        only the new tokens that continue that sequence. ``segment_ids`` and ``context_parallel``
        (x (b, n_local): this rank's slice) as in ``LinearAttentionTransformer.forward``."""
        out = self._body(x, input_mask, context, context_mask, cache, return_cache, segment_ids, context_parallel)
        if not return_cache:
            return self._output(out)
        out, cache = out
        return self._output(out), cache

    def start_decoding(self, x, input_mask=None, context=None, context_mask=None):
        """Read the prompt x (b, n) and return (logits (b, num_tokens) at its last position,
        decoder); ``decoder.step(tokens (b,))`` then feeds one token per row and returns the
        logits after it. The fast form of ``forward(..., cache=...)`` for one token at a time
        (``decoding.py``); it runs without gradients and assumes eval mode."""
        # not in inference mode: the buffers are then ordinary tensors, updatable in place in any mode
        with torch.no_grad():
            out, cache = self._body(x, input_mask, context, context_mask, None, True)
            return self._output(out[:, -1]), Decoder(self, cache, x.shape[0], input_mask)

    def prepare_step(self, cache, batch, first_real=None):
        """What ``step`` reads besides ``cache`` (a ``DecodingCache`` of ``batch`` rows), made
        once per decoder: the position embeddings of every position as one table (when it
        has at most ``POSITION_TABLE_ELEMENTS`` entries) and each branch's ``prepare_step``
        (``first_real``: see ``attention.StepTensors``)."""
        position = cache.position
        layers = [(f.prepare_step(fc, batch, position, first_real), g.prepare_step(gc, batch, position, first_real))
                  for (f, g), (fc, gc) in zip(self.transformer.layers.blocks, cache.layers)]
        table = rows = None
        token = self.token_emb.weight
        if self.pos_emb is not None and self.max_seq_len * token.shape[1] <= POSITION_TABLE_ELEMENTS:
            with torch.no_grad():
                table = self.pos_emb(torch.arange(self.max_seq_len, device=token.device)).to(token.dtype)
            rows = table.unbind(0)  # (eager steps: a row without an indexing op)
        return StepTensors(table, rows, layers)

    def step(self, tokens, cache, made, at):
        """tokens (b,) at ``at`` (a step's ``Place``: ``position`` an int on eager steps, else
        None; ``tensor`` the same as a long tensor) through the model on ``cache``, in place ->
        logits (b, num_tokens). ``made``: ``prepare_step``'s tensors."""
        h = F.embedding(tokens, self.token_emb.weight)
        if made.table is not None:
            # (a tensor index is an embedding lookup: indexing with it would read it back)
            h = h + (F.embedding(at.tensor, made.table) if at.position is None else made.rows[at.position])
        elif self.pos_emb is not None:
            h = h + self.pos_emb(at.tensor[None]).to(h.dtype)
        if not isinstance(self.project_in, nn.Identity):
            h = self.project_in(h)
        return self._output(self.transformer.step(h, cache, made.layers, at))

    def output_features(self, x, input_mask=None, context=None, context_mask=None, segment_ids=None,
                        context_parallel=None):
        """What the logits are read from: (b, n, emb_dim), with ``forward(x, ...) ==
        output_layer(output_features(x, ...))`` (``AutoregressiveWrapper``'s chunked loss)."""
        if self.return_embeddings:
            raise ValueError("a model with return_embeddings=True has no output layer")
        out = self._body(x, input_mask, context, context_mask, None, False, segment_ids, context_parallel)
        return self.project_out(self.norm(out))

    @property
    def output_layer(self):
        """The last Linear(emb_dim, num_tokens) (None with return_embeddings)."""
        return self.to_logits

    def _body(self, x, input_mask, context, context_mask, cache, return_cache, segment_ids=None,
              context_parallel=None):
        check_integer_ids(x, "x")
        if x.ndim != 2 or x.shape[1] < 1:
            raise ValueError(f"x must have shape (batch, seq_len) with at least one token, got {tuple(x.shape)}")
        place = Place.of(x, cache, return_cache, segment_ids, context_parallel, check=self.transformer.check_place)
        positions = place.positions(x.shape[1], x.device)
        h = self._embed(x)
        if self.pos_emb is not None:
            h = h + self.pos_emb(positions).to(h.dtype)
        # updated in place and returned; read without return_cache, it is left as it was
        out = self.transformer.attend(self.project_in(h), place, input_mask, context, context_mask,
                                      cache if return_cache or cache is None else cache.clone(), positions)
        return out[0] if place.cached and not return_cache else out

    def _embed(self, x):
        """The token embedding (ids of any integer dtype: the embedding takes int64); ids outside
        the vocabulary are looked for (``check_token_ids``) only once it has failed, so valid
        ids cost no host sync (a GPU asserts on the device)."""
        try:
            return self.token_emb(x if x.dtype == torch.int64 else x.long())
        except IndexError:
            check_token_ids(x, self.num_tokens, "x")
            raise

    def _output(self, out):
        return _logits(out, *self._output_args())

    def _output_args(self):
        """The norm's arguments and the (weight, bias) of project_out (None: Identity) and of
        to_logits (None: return_embeddings), for ``_logits``."""
        norm = self.norm
        project_out = None if isinstance(self.project_out, (nn.Identity, type(None))) else self.project_out
        return ((norm.normalized_shape, norm.weight, norm.bias, norm.eps),
                None if project_out is None else (project_out.weight, project_out.bias),
                None if self.return_embeddings else (self.to_logits.weight, self.to_logits.bias))


def _logits(out, norm_args, project_out, to_logits):
    out = torch.layer_norm(out, *norm_args)
    if to_logits is None:  # return_embeddings
        return out
    if project_out is not None:
        out = F.linear(out, *project_out)
    return F.linear(out, *to_logits)


# a decoder keeps the position embeddings of every position when they are at most this many numbers
POSITION_TABLE_ELEMENTS = 2 ** 23


class StepTensors(NamedTuple):
    """What ``LinearAttentionTransformerLM.step`` reads besides its cache, made once per decoder:
    the position table (or None) and its rows, and per block the branches' ``prepare_step``."""

    table: Optional[torch.Tensor]
    rows: Optional[tuple]
    layers: list
