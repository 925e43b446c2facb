"""Fast decoding: a running decoder that takes one token per row per step.

``LinearAttentionTransformerLM.forward(x, cache=...)`` (``cache.py``) is the general form of
cached decoding: any number of new tokens, masks, caches that are never modified, so that a
caller can branch from one. It pays for that generality at every call: validation, shapes
worked out again, a new cache object per layer, the local heads' keys concatenated anew. A
decoding step does microseconds of useful work (a few matrix-vector products), so that
overhead is nearly all of its time.

``Decoder`` is the lean form for the common loop (``AutoregressiveWrapper.generate``): it is
primed once from the general form's cache, then ``step(tokens)`` feeds one token per row and
returns the next logits. It keeps its state in its own buffers and updates them in place (a
decoder is one running sequence: there is nothing to branch from), checks its arguments
once, and runs each layer as a short fixed list of tensor operations:

* attention: one matmul projects the token to every head's q, k and v at once, and to the
  gates' inputs (the projection weights concatenated once, when the decoder is built: the
  model's parameters and state_dict are untouched);
* local heads: keys and values go to a ring buffer of the window's size (slot = position
  mod size), so no step concatenates or slices the past; which slots the query sees is a
  0 / -inf bias shared by every layer; scores and readouts are products and sums, not
  batched matmuls (those of such tiny shapes run on every thread, and on a busy machine
  waiting for the other threads costs milliseconds per call);
* global heads: the recurrence of ``ops/linear_attention.py`` (``causal_linear_attention_step``,
  its reference, with the same per-feature references for exponential features, so the
  step stays exact at any logit size) written as few operations (``global_step``); with a
  blindspot and no forget gate, a step only writes its key and value to a buffer of the
  block and reads the state, and the whole block joins the state when it is complete
  (``block_sum``: the keys of the block at once, relative to their maximum);
* the window's bias (once the prompt's padding has left the window) and the global heads'
  "has every row seen a key yet" follow from the position alone, so the common step reads
  the bias from a table and carries no guard for the first tokens;
* feed-forward, norms, token shift, position embedding (looked up from a table built for
  a stretch of positions at a time): plain functional calls, no module dispatch.

Every step equals the general form to rounding (tests/test_decoding.py, float64 against the
full forward). A model with a layer this file does not know (``attend_axially``) gets
``CacheDecoder``, the same interface over the general form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .feedforward import FeedForward
from .ops.linear_attention import _complete_block, _divide, _exp_ratio
from .positional import apply_rotary
from .reversible import ReversibleSequence

__all__ = ["Decoder", "CacheDecoder", "start_decoding"]

NEG_INF = float("-inf")
# position embeddings (and rotary angles) are looked up from tables of this many positions
POSITION_TABLE = 256


def start_decoding(model, x, input_mask=None, context=None, context_mask=None):
    """Prime a decoder with the prompt ``x`` (b, n). Returns (logits (b, num_tokens) at the
    prompt's last position, decoder): ``Decoder`` when every layer of the model has a lean
    step, else ``CacheDecoder``."""
    with torch.inference_mode():
        out, cache = model._body(x, input_mask, context, context_mask, None, True)
        logits = model._output(out[:, -1])
        if Decoder.supports(model):
            return logits, Decoder(model, cache, x.shape[0], input_mask)
    return logits, CacheDecoder(model, cache)


class CacheDecoder:
    """The decoder interface over the general cached form: ``step`` calls
    ``model(tokens[:, None], cache=cache, return_cache=True)``."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    @property
    def position(self):
        return self.cache.position

    @torch.inference_mode()
    def step(self, tokens):
        logits, self.cache = self.model(tokens[:, None], cache=self.cache, return_cache=True)
        return logits[:, -1]


class Decoder:
    """One running sequence per row, one token per row per step, state updated in place.

    Built by ``start_decoding`` (or ``LinearAttentionTransformerLM.start_decoding``) from
    the model and the ``DecodingCache`` of its prompt. The projection weights are copied
    (concatenated) when it is built: parameters changed afterwards are not seen.

    ``step(tokens (b,) long) -> logits (b, num_tokens)`` for the token after them.
    ``position``: tokens consumed so far (prompt included).
    """

    @staticmethod
    def supports(model):
        """Whether every branch of ``model`` (an LM) has a lean step."""
        branches = [branch for pair in model.transformer.layers.blocks for branch in pair]
        return all(isinstance(branch.fn, Attention) or not branch.stateful for branch in branches)

    def __init__(self, model, cache, batch, input_mask=None):
        transformer = model.transformer
        self.position, self.batch = cache.position, batch
        # the latest first real token over the rows (prompts are padded on the left)
        self.first_real = 0
        if input_mask is not None:  # (a row without any: its first generated token)
            first = torch.where(input_mask.any(dim=1), input_mask.int().argmax(dim=1), input_mask.shape[1])
            self.first_real = int(first.max())
        self.reversible = isinstance(transformer.layers, ReversibleSequence)
        self.max_seq_len = model.max_seq_len
        self.device = model.token_emb.weight.device
        # the windows of the local heads: one ring of slots per distinct window, shared by
        # every layer that has it (the slots' positions and real-token flags)
        self.rings = {}
        self.rotary = transformer.rotary
        self.blocks = [
            (self._branch(f, f_cache), self._branch(g, g_cache))
            for (f, g), (f_cache, g_cache) in zip(transformer.layers.blocks, cache.layers)
        ]
        self.embedding = _PositionTables(model, self.device)

    def _branch(self, branch, cache):
        fn = branch.fn
        if isinstance(fn, Attention) and fn.receives_context:
            step = _ContextStep(fn, cache.fn)
        elif isinstance(fn, Attention):
            step = _AttentionStep(fn, cache.fn, self)
        elif isinstance(fn, FeedForward):
            step = _FeedForwardStep(fn)
        else:  # stateless (product-key memory): the module on the one token
            step = _ModuleStep(fn)
        return _BranchStep(branch, cache.shift, step)

    def seen_from(self, blindspot_size):
        """The position from which every row's query sees a key of the global heads: the
        block after each row's first real token (with ``blindspot_size`` 1, its own key)."""
        if blindspot_size == 1:
            return 0
        return (self.first_real // blindspot_size + 1) * blindspot_size

    def ring(self, window, cache):
        """The shared slot bookkeeping of ``window``, created from the first layer's cache."""
        ring = self.rings.get(window)
        if ring is None:
            ring = self.rings[window] = _Ring(window, cache, self.batch, self.device)
        return ring

    def step(self, tokens):
        if torch.is_inference_mode_enabled():  # (generate runs in it: no context to enter)
            return self._step(tokens)
        with torch.inference_mode():
            return self._step(tokens)

    def _step(self, tokens):
        p = self.position
        if p >= self.max_seq_len:
            raise ValueError(f"sequence length {p + 1} exceeds max_seq_len={self.max_seq_len}")
        for ring in self.rings.values():
            ring.advance(p)
        ctx = _StepContext(p, self.rotary_at(p))
        x = self.embedding(tokens, p)
        if self.reversible:
            x1 = x2 = x
            for f, g in self.blocks:
                y1 = x1 + f(x2, ctx)
                x2 = x2 + g(y1, ctx)
                x1 = y1
            x = (x1 + x2) / 2
        else:
            for f, g in self.blocks:
                x = x + f(x, ctx)
                x = x + g(x, ctx)
        self.position = p + 1
        return self.embedding.logits(x)

    def rotary_at(self, p):
        if self.rotary is None:
            return None
        return self.embedding.rotary(self.rotary, p)


class _StepContext:
    __slots__ = ("position", "rotary")

    def __init__(self, position, rotary):
        self.position, self.rotary = position, rotary


class _PositionTables:
    """Token and position embeddings in, logits out, for one position at a time.

    Position embeddings (and rotary angles) are computed by the model's own modules for
    ``POSITION_TABLE`` positions at a time and read row by row: the same numbers as the
    general form, without a module call per step."""

    def __init__(self, model, device):
        self.max_seq_len = model.max_seq_len
        self.token = model.token_emb.weight
        self.pos_emb = model.pos_emb
        self.project_in = None if isinstance(model.project_in, nn.Identity) else model.project_in
        self.norm = model.norm
        self.project_out = None if isinstance(model.project_out, nn.Identity) else model.project_out
        self.to_logits = model.to_logits
        self.device = device
        self.start = self.table = None
        self.rotary_start = self.rotary_table = None

    def _positions(self, p):
        stop = min(p + POSITION_TABLE, self.max_seq_len)
        return torch.arange(p, stop, device=self.device)

    def __call__(self, tokens, p):
        h = F.embedding(tokens, self.token)
        if self.pos_emb is not None:
            if self.start is None or not 0 <= p - self.start < self.table.shape[0]:
                self.start, self.table = p, self.pos_emb(self._positions(p)).to(h.dtype)
            h = h + self.table[p - self.start]
        if self.project_in is not None:
            h = F.linear(h, self.project_in.weight, self.project_in.bias)
        return h

    def rotary(self, rotary, p):
        if self.rotary_start is None or not 0 <= p - self.rotary_start < self.rotary_table[0].shape[0]:
            self.rotary_start, self.rotary_table = p, rotary(self._positions(p))
        i = p - self.rotary_start
        return self.rotary_table[0][i], self.rotary_table[1][i]

    def logits(self, x):
        norm = self.norm
        x = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        if self.to_logits is None:  # return_embeddings
            return x
        if self.project_out is not None:
            x = F.linear(x, self.project_out.weight, self.project_out.bias)
        return F.linear(x, self.to_logits.weight, self.to_logits.bias)


class _BranchStep:
    """LayerNorm, token shift (the previous token's normalised features kept), then the step."""

    __slots__ = ("norm", "shift_sizes", "previous", "step")

    def __init__(self, branch, previous, step):
        self.norm = branch.norm
        self.shift_sizes = None
        self.previous = previous
        if branch.shifts is not None:
            if tuple(branch.shifts) != (1, 0):
                raise ValueError(f"a causal decoder shifts by (1, 0), got {branch.shifts}")
            dim = branch.norm.normalized_shape[0]
            self.shift_sizes = (dim // 2, dim - dim // 2)
        self.step = step

    def __call__(self, x, ctx):
        norm = self.norm
        h = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        if self.shift_sizes is not None:
            # slice 0 comes from the token before, slice 1 stays (token_shift.shift_tokens)
            before = self.previous[:, : self.shift_sizes[0]]
            self.previous = h
            h = torch.cat((before, h[:, self.shift_sizes[0]:]), dim=-1)
        return self.step(h, ctx)


class _FeedForwardStep:
    __slots__ = ("proj_in", "proj_out", "glu", "activation")

    def __init__(self, ff):
        self.proj_in, self.proj_out = ff.proj_in, ff.proj_out
        self.glu, self.activation = ff.glu, ff.activation

    def __call__(self, h, ctx):
        h = F.linear(h, self.proj_in.weight, self.proj_in.bias)
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * self.activation(gate)
        else:
            h = self.activation(h)
        return F.linear(h, self.proj_out.weight, self.proj_out.bias)


class _ModuleStep:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, h, ctx):
        return self.fn(h[:, None])[:, 0]


class _ContextStep:
    """Cross-attention: the context was reduced to kᵀv on the first call; read it."""

    __slots__ = ("attn", "cache")

    def __init__(self, attn, cache):
        self.attn, self.cache = attn, cache

    def __call__(self, h, ctx):
        return self.attn(h[:, None], cache=self.cache)[:, 0]


class _Ring:
    """Slots of a local window's ring buffer: key position p sits in slot p mod size.

    ``size`` is the most keys a query can see ((look_backward + 1) * w, or look_backward * w
    with ``exact``). Entering position p, ``bias`` (b or 1, 1, size) becomes 0 on the slots
    its query sees and -inf on the others (``Window.visible``, and real tokens only).

    While the ring may still hold the prompt's padding or positions before 0, the slots'
    positions and real-token flags are kept and compared; from then on the pattern depends
    on p mod size only, and is read from a table made once."""

    def __init__(self, window, cache, batch, device):
        w, L = window.size, window.look_backward
        self.window = window
        self.size = size = L * w if window.exact else (L + 1) * w
        dtype = cache.keys.dtype
        self.positions = torch.full((size,), -size - 1, dtype=torch.long, device=device)
        self.real = torch.zeros(batch, size, dtype=torch.bool, device=device)
        self.slot = self.bias = None
        m = cache.keys.shape[2]
        padded_until = -1  # the last position of the prompt's padding still in the cache
        if m:
            slots = self.slots_of(cache.start, m)
            self.positions[slots] = torch.arange(cache.start, cache.start + m, device=device)
            self.real[:, slots] = cache.mask
            padding = (~cache.mask).any(dim=0).nonzero()
            if padding.numel():
                padded_until = cache.start + int(padding[-1])
        # from `steady` on every slot holds a real key at a position >= 0
        self.steady = max(size, padded_until + size + 1)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.hidden = torch.tensor(NEG_INF, dtype=dtype, device=device)
        p = size + torch.arange(size, device=device)[:, None]  # one query per residue mod size
        slot_positions = p - (p - torch.arange(size, device=device)) % size
        self.table = torch.where(window.visible(p, slot_positions), self.zero, self.hidden)[:, None, None]

    def slots_of(self, start, count):
        return torch.arange(start, start + count, device=self.positions.device) % self.size

    def advance(self, p):
        """Enter position p: its slot now holds a real key at p."""
        self.slot = slot = p % self.size
        if p >= self.steady:
            self.bias = self.table[slot]
            return
        self.positions[slot] = p
        self.real[:, slot] = True
        seen = self.window.visible(p, self.positions) & self.real
        self.bias = torch.where(seen, self.zero, self.hidden)[:, None]


class _AttentionStep:
    """One token through an ``Attention`` layer (self-attention, causal)."""

    def __init__(self, attn, cache, decoder):
        heads, dh, kvh = attn.heads, attn.dim_head, attn.kv_heads
        self.heads, self.dim_head, self.kv_heads = heads, dh, kvh
        self.n_local, self.n_global = nl, ng = attn.n_local, heads - attn.n_local
        # one projection for q, k, v and the gates' inputs: the weights concatenated once
        weights, sizes = [attn.to_q.weight, attn.to_kv.weight], [heads * dh, 2 * kvh * dh]
        gate, out_gate = attn.forget_gate, attn.output_gate
        if gate is not None:
            weights.append(gate.gate_down.weight)
            sizes.append(gate.gate_down.out_features)
        if out_gate is not None:
            weights.append(out_gate.gate_out.weight)
            sizes.append(out_gate.gate_out.out_features)
        with torch.no_grad():
            self.weight = torch.cat(weights, dim=0)
            self.bias = None
            if out_gate is not None:  # only the output gate has a bias: the others add exact zeros
                self.bias = torch.cat((self.weight.new_zeros(sum(sizes[:-1])), out_gate.gate_out.bias))
        self.ends = torch.tensor(sizes).cumsum(0).tolist()
        self.to_out, self.gate, self.out_gate = attn.to_out, gate, out_gate
        self.rotary = decoder.rotary is not None
        self.scale = dh ** -0.5
        b = decoder.batch

        if nl:
            local = cache.local
            self.ring = decoder.ring(attn.local_window, local)
            size = self.ring.size
            # keys and values of the local heads: (2, b * local heads, slots, dh), so that the
            # step's writes and reads are views made once
            ring = torch.zeros(2, b, nl, size, dh, dtype=local.keys.dtype, device=local.keys.device)
            m = local.keys.shape[2]
            if m:
                slots = self.ring.slots_of(local.start, m)
                ring[0, :, :, slots] = local.keys
                ring[1, :, :, slots] = local.values
            self.slot_views = [ring[:, :, :, slot] for slot in range(size)]  # (2, b, nl, dh) each
            self.keys, self.values = ring[0], ring[1]  # (b, nl, slots, dh) views
        if ng:
            self.blindspot = attn.blindspot_size
            self.exp_features = attn.feature_map.is_softmax
            self.feature_map = attn.feature_map
            state = cache.global_.state
            self.state = (state.kv, state.ref, state.pending, state.pending_ref)
            self.state_dtype = state.kv.dtype
            self.seen_from = decoder.seen_from(self.blindspot)
            self.block = None
            if self.blindspot > 1 and gate is None:
                # (b, 2, global heads, B, dh): the keys and values of the current block's steps
                B = self.blindspot
                self.block = torch.zeros(b, 2, ng, B, dh, dtype=self.state_dtype, device=state.kv.device)
                self.block_keys = [self.block[:, 0, :, i] for i in range(B)]
                self.block_values = [self.block[:, 1, :, i] for i in range(B)]
                self.block_start = decoder.position % B
            self.conv = None
            if attn.local_conv is not None:
                # the three convolutions (q, k, v) as one: weights (3, global heads, taps, dh)
                with torch.no_grad():
                    self.conv_weight = torch.stack(
                        [c.conv_weight.reshape(ng, dh, c.kernel_size).transpose(1, 2) for c in attn.local_conv]
                    )
                self.conv = torch.stack(cache.global_.conv, dim=1)  # (b, 3, global heads, taps - 1, dh)
            if gate is not None:
                self.gate_up, self.gate_per_head = gate.gate_up, gate.granularity == "head"
                self.temperature = gate.temperature

    def __call__(self, h, ctx):
        b = h.shape[0]
        heads, dh, kvh, nl = self.heads, self.dim_head, self.kv_heads, self.n_local
        proj = F.linear(h, self.weight, self.bias)
        q_end, kv_end = self.ends[0], self.ends[1]
        if self.rotary:  # q and k are side by side: rotate them at once
            qk = apply_rotary(proj[:, : q_end + kvh * dh].view(b, heads + kvh, dh), ctx.rotary)
            q = qk[:, :heads]
            kv = torch.stack((qk[:, heads:], proj[:, q_end + kvh * dh : kv_end].view(b, kvh, dh)), dim=1)
        else:
            q = proj[:, :q_end].view(b, heads, dh)
            kv = proj[:, q_end:kv_end].view(b, 2, kvh, dh)
        if kvh != heads:
            kv = kv.repeat_interleave(heads // kvh, dim=2)
        outs = []
        if nl:
            outs.append(self._local(q[:, :nl], kv[:, :, :nl], b))
        if self.n_global:
            log_gate = None if self.gate is None else self._log_gate(proj[:, kv_end : self.ends[2]])
            outs.append(self._global(q[:, nl:], kv[:, 0, nl:], kv[:, 1, nl:], log_gate, ctx.position))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = out.reshape(b, heads * dh)
        if self.out_gate is not None:
            out = out * torch.sigmoid(proj[:, self.ends[-2]:])
        return F.linear(out, self.to_out.weight, self.to_out.bias)

    def _local(self, q, kv, b):
        ring = self.ring
        self.slot_views[ring.slot].copy_(kv.transpose(0, 1))
        # products and sums, not matmuls: a batched matmul of these tiny shapes runs on every
        # thread, and on a busy machine waiting for the other threads costs milliseconds
        sim = (q[:, :, None] * self.keys).sum(dim=-1) * self.scale + ring.bias  # (b, h, slots)
        return (sim.softmax(dim=-1)[..., None] * self.values).sum(dim=-2)  # the query sees its own key

    def _log_gate(self, down):
        logits = F.linear(down, self.gate_up.weight, self.gate_up.bias)
        log_a = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))) / self.temperature
        return log_a if self.gate_per_head else log_a.view(log_a.shape[0], self.n_global, self.dim_head)

    def _global(self, q, k, v, log_gate, position):
        if self.conv is not None:
            window = torch.cat((self.conv, torch.stack((q, k, v), dim=1)[:, :, :, None]), dim=3)
            self.conv = window[:, :, :, 1:]  # the raw inputs, for the next steps
            q, k, v = (window * self.conv_weight).sum(dim=3).unbind(1)
        if not self.exp_features:
            q, k = self.feature_map._pointwise(q), self.feature_map._pointwise(k)
        dtype = out_dtype = q.dtype
        if dtype != self.state_dtype:
            dtype = self.state_dtype
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            log_gate = None if log_gate is None else log_gate.to(dtype)
        if self.block is None:
            out, self.state = global_step(q, k, v, self.state, log_gate, self.blindspot, self.exp_features, position,
                                          position >= self.seen_from)
        else:
            out = self._blindspot_step(q, k, v, position)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def _blindspot_step(self, q, k, v, position):
        """Without decay, the keys of a blindspot block wait in a buffer and join the state
        at once when the block is complete (``block_sum``): a step writes them and reads the
        state of the earlier blocks."""
        slot = position % self.blindspot
        self.block_keys[slot].copy_(k)
        self.block_values[slot].copy_(v)
        kv, ref, pending, pending_ref = self.state
        out = read_state(q, kv, ref, self.exp_features, position >= self.seen_from)
        if slot == self.blindspot - 1:
            start, self.block_start = self.block_start, 0  # (the prompt's part of the first block is in pending)
            keys, values = self.block[:, 0, :, start:], self.block[:, 1, :, start:]
            pending, pending_ref = block_sum(keys, values, pending, pending_ref, self.exp_features)
            self.state = _complete_block(kv, ref, pending, pending_ref, self.exp_features)
        return out


def global_step(q, k, v, state, log_decay, blindspot_size, exp_features, position, all_seen=False):
    """One token of causal linear attention on plain tensors: the lean form of
    ``ops.causal_linear_attention_step`` (same math, same references, no autograd care).

    q, k: (b, h, d) features, or logits with ``exp_features``; v: (b, h, e);
    state: (kv (b, h, d, e + 1), ref (b, h, d) or None, pending, pending_ref) as in
    ``CausalState``; log_decay: None, (b, h) or (b, h, d); position: tokens before this one;
    all_seen: the caller knows that every row's query sees a key (its denominator is then >= 1
    with exponential features, and nothing needs guarding against an empty state).
    Returns (out (b, h, e), new state tuple). Every token is real (a decoder's are)."""
    kv, ref, pending, pending_ref = state
    v1 = F.pad(v, (0, 1), value=1.0)[:, :, None, :]  # the normaliser's column of ones
    if log_decay is not None:
        ld = log_decay[..., None] if log_decay.ndim == 2 else log_decay  # (b, h, 1 or d)
        if exp_features:  # the decay moves the references, not the sums
            ref = ref + ld
            pending_ref = None if pending_ref is None else pending_ref + ld
        else:
            a = ld.exp()[..., None]
            kv = kv * a
            pending = None if pending is None else pending * a
    blindspot = blindspot_size > 1
    acc, acc_ref = (pending, pending_ref) if blindspot else (kv, ref)
    if exp_features:
        # a finite key moves the reference to max(ref, k): factors exp(ref - new) <= 1 and
        # exp(k - new) <= 1, so the largest term stays 1
        new_ref = torch.maximum(acc_ref, k)
        acc = torch.addcmul(acc * (acc_ref - new_ref).exp()[..., None], (k - new_ref).exp()[..., None], v1)
        acc_ref = new_ref
    else:
        acc = torch.addcmul(acc, k[..., None], v1)
    if blindspot:
        pending, pending_ref = acc, acc_ref
    else:
        kv, ref = acc, acc_ref
    out = read_state(q, kv, ref, exp_features, all_seen)
    if blindspot and (position + 1) % blindspot_size == 0:
        return out, _complete_block(kv, ref, pending, pending_ref, exp_features)
    return out, (kv, ref, pending, pending_ref)


def read_state(q, kv, ref, exp_features, all_seen=False):
    """A query reads a state: q (b, h, d), kv (b, h, d, e + 1) relative to ref (b, h, d) (or
    None) -> (b, h, e). With exponential features the query's factors are exp(q + ref - M),
    M = max_d (q_d + ref_d): the largest is 1, so the denominator is >= 1 once a key is seen;
    before any key (ref all -inf) every factor is 0 and so is the output."""
    if not exp_features:  # (products and sums rather than a batched matmul: see _local)
        return _divide((q[..., None] * kv).sum(dim=-2))
    logits = q + ref
    top = logits.amax(dim=-1, keepdim=True)
    if not all_seen:  # a row before any key: ref and top are -inf; a finite top gives 0 / 0 -> 0 / 1
        top = top.clamp(min=-torch.finfo(logits.dtype).max)
    out = ((logits - top).exp()[..., None] * kv).sum(dim=-2)
    den = out[..., -1:]
    return out[..., :-1] / (den if all_seen else den.clamp(min=1.0))


def block_sum(keys, values, pending, pending_ref, exp_features):
    """The keys (b, h, l, d) and values (b, h, l, e) of a blindspot block's steps added to
    ``pending`` at once (no decay inside the block): what l steps of the recurrence add, with
    the reference moved to the largest key first. Returns (pending, pending_ref)."""
    v1 = F.pad(values, (0, 1), value=1.0)
    if not exp_features:
        return pending + keys.transpose(-1, -2) @ v1, pending_ref
    new_ref = torch.maximum(pending_ref, keys.amax(dim=2))
    added = (keys - new_ref[:, :, None]).exp().transpose(-1, -2) @ v1
    return pending * _exp_ratio(pending_ref, new_ref)[..., None] + added, new_ref
