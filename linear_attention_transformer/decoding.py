"""Fast decoding: a running decoder that takes one token per row per step.

``LinearAttentionTransformerLM.forward(x, cache=...)`` (``cache.py``) is the general form of
cached decoding: any number of new tokens, masks, caches that are never modified, so that a
caller can branch from one. It pays for that generality at every call: validation, shapes
worked out again, a new cache object per layer, the local heads' keys concatenated anew. A
decoding step does microseconds of useful work (a few matrix-vector products), so that
overhead is nearly all of its time.

``Decoder`` is the lean form for the common loop (``AutoregressiveWrapper.generate``): it is
primed once from the general form's cache, then ``step(tokens)`` feeds one token per row and
returns the next logits. It keeps its state in buffers of fixed shape, allocated when it is
built and updated in place (a decoder is one running sequence: there is nothing to branch
from), and runs each layer as a short fixed list of tensor operations:

* the position is a tensor on the model's device, advanced in place. Nothing a step does
  depends on a Python value that changes from step to step: every choice that follows from
  the position (which ring slot to write, which slots the window sees, whether a blindspot
  block is complete) is a tensor operation. So a step reads nothing back to the host (no
  sync: ``tests/test_decoding.py`` counts them with a dispatch mode), allocates nothing that
  lasts, and ``torch.compile(decoder.step, fullgraph=True)`` traces it into one graph that
  is reused at every position (no recompile), which ``mode="reduce-overhead"`` can capture
  as a CUDA graph (on a CUDA device the buffers are marked as static addresses, so that the
  graph may update them in place);
* attention: one matmul projects the token to every head's q, k and v at once, and to the
  gates' inputs (the projection weights concatenated once, when the decoder is built: the
  model's parameters and state_dict are untouched);
* local heads: keys and values go to a ring buffer of the window's size (slot = position
  mod size), so no step concatenates or slices the past; the ring also keeps each slot's
  position per row (padding of the prompt: a position no window reaches), and the query
  sees the slots whose position lies in its window: a 0 / -inf bias shared by every layer
  with that window; scores and readouts are products and sums, not batched matmuls (those
  of such tiny shapes run on every thread, and on a busy machine waiting for the other
  threads costs milliseconds per call);
* global heads: the recurrence of ``ops/linear_attention.py`` (``causal_linear_attention_step``,
  its reference, with the same per-feature references for exponential features, so the
  step stays exact at any logit size) written in place on the state (``GlobalHeads``); with
  a blindspot, the keys of the current block gather in ``pending`` and join the state when
  the block is complete: every step does the join, scaled by a flag that is 1 at the
  block's last position and 0 elsewhere (0 leaves the state bit for bit as it was). With a
  blindspot and no forget gate (``BlockHeads``) the block's keys and values wait as they are
  in a buffer of the block's size and join at once: a step writes them and reads the state;
* eager steps know the position on the host too (a count the decoder keeps) and use it
  where it saves work: a slot is written through a view made once (``copy_`` rather than
  ``index_copy_``), a block joins only at its last position, the window's bias and the
  position embedding are rows of tables. A compiled step does the same as tensor
  operations, on the device's position;
* feed-forward, norms, token shift, position embedding (the model's own module on the
  position tensor): plain functional calls.

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
from .positional import apply_rotary
from .reversible import ReversibleSequence

__all__ = ["Decoder", "CacheDecoder", "GlobalHeads", "start_decoding"]

NEG_INF = float("-inf")
# the position of a ring slot that holds no key (before the prompt, or its padding): below
# the start of every window
NO_KEY = -(2 ** 62)
# a decoder keeps the position embeddings of every position when they are at most this many numbers
POSITION_TABLE_ELEMENTS = 2 ** 23
# eager steps on a CPU for at most this many rows run on one thread (Decoder.step_threads)
ONE_THREAD_MAX_BATCH = 8
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def start_decoding(model, x, input_mask=None, context=None, context_mask=None):
    """Prime a decoder with the prompt ``x`` (b, n). Returns (logits (b, num_tokens) at the
    prompt's last position, decoder): ``Decoder`` when every layer of the model has a lean
    step, else ``CacheDecoder``."""
    with torch.inference_mode():
        out, cache = model._body(x, input_mask, context, context_mask, None, True)
        logits = model._output(out[:, -1])
        if not Decoder.supports(model):
            return logits, CacheDecoder(model, cache)
    # built outside inference mode: its buffers are then ordinary tensors, which a step may
    # update in place with or without inference mode (and under torch.compile)
    with torch.no_grad():
        return logits.clone(), Decoder(model, cache, x.shape[0], input_mask)


class CacheDecoder:
    """The decoder interface over the general cached form: ``step`` calls
    ``model(tokens[:, None], cache=cache, return_cache=True)`` (not one graph: its caches are
    new objects at every step)."""

    compilable = False

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    @property
    def position(self):
        return self.cache.position

    @torch.inference_mode()
    def step(self, tokens):
        logits, self.cache = self.model(tokens[:, None], cache=self.cache, return_cache=True)
        return logits[:, -1]


def _check_step_tokens(tokens, batch):
    if not torch.is_tensor(tokens) or tokens.dtype not in _INTEGER_DTYPES:
        what = tokens.dtype if torch.is_tensor(tokens) else type(tokens).__name__
        raise TypeError(f"tokens must be an integer tensor of token ids, got {what}")
    if tuple(tokens.shape) != (batch,):
        raise ValueError(f"tokens must have shape ({batch},): one token per row, got {tuple(tokens.shape)}")


class Decoder:
    """One running sequence per row, one token per row per step, state updated in place.

    Built by ``start_decoding`` (or ``LinearAttentionTransformerLM.start_decoding``) from
    the model and the ``DecodingCache`` of its prompt. The attention layers' projection
    weights are copied (concatenated) when it is built: parameters changed afterwards are not
    seen. Eager steps under autocast take the form a compiled step traces.

    ``step(tokens (b,) integer) -> logits (b, num_tokens)`` for the token after them. It makes
    no host sync and keeps every buffer at its shape, so that
    ``torch.compile(decoder.step, fullgraph=True)`` gives one graph for every position
    (``mode="reduce-overhead"``: a CUDA graph). Run eagerly it checks ``max_seq_len`` against a
    count kept on the host; compiled, on the device (``torch._assert_async``).

    ``position``: tokens consumed so far (prompt included), an int. After compiled steps it is
    read back from the device once (a sync: read it between steps, not inside a loop that
    must not wait).

    ``step_threads``: the torch thread count an eager step runs with, torch's own count
    restored after it (None: torch's count as it is). On a CPU it is 1 for at most
    ``ONE_THREAD_MAX_BATCH`` rows: a step is some fifty small operations, which a second
    thread does not speed up, and each that uses one waits for it; when another process
    holds the other core that wait is milliseconds (benchmark model, 2 threads on a busy
    2-core machine, 2026-11-24: a step of one row 0.53 ms at best and 0.61 ms median on one
    thread against 0.57 ms and 37 ms on two; eight rows 1.26 / 2.1 ms against 1.9 / 12 ms).
    Set it to None, or to a count, on the decoder to choose otherwise.
    """

    compilable = True  # (AutoregressiveWrapper.generate's compile_step)

    @staticmethod
    def supports(model):
        """Whether every branch of ``model`` (an LM) has a lean step."""
        branches = [branch for pair in model.transformer.layers.blocks for branch in pair]
        return all(isinstance(branch.fn, Attention) or not branch.stateful for branch in branches)

    def __init__(self, model, cache, batch, input_mask=None):
        transformer = model.transformer
        self.batch = batch
        # the latest first real token over the rows (prompts are padded on the left)
        self.first_real = 0
        if input_mask is not None:  # (a row without any: its first generated token; built once: a sync is fine)
            first = torch.where(input_mask.any(dim=1), input_mask.int().argmax(dim=1), input_mask.shape[1])
            self.first_real = int(first.max())
        self.reversible = isinstance(transformer.layers, ReversibleSequence)
        self.max_seq_len = model.max_seq_len
        self.device = device = model.token_emb.weight.device
        self.step_threads = 1 if device.type == "cpu" and batch <= ONE_THREAD_MAX_BATCH else None
        # the position: on the device for the step, and on the host for eager steps' check
        self._position = torch.tensor(cache.position, dtype=torch.long, device=device)
        self._host_position = cache.position
        # what follows from the position, computed once per step for every layer that needs it:
        # the local windows' rings (one per distinct window), the blindspots' join flags
        # (GlobalHeads) and block slots (BlockHeads)
        self.rings, self.windows = [], []  # the rings and their windows, in the same order
        self.joins = []  # (blindspot_size, dtype, exp_features, 0, -inf in that dtype)
        self.block_sizes = []  # the blindspot sizes of BlockHeads
        self.rotary = transformer.rotary
        self.blocks = [
            (self._branch(f, f_cache), self._branch(g, g_cache))
            for (f, g), (f_cache, g_cache) in zip(transformer.layers.blocks, cache.layers)
        ]
        self.embedding = _Embedding(model, device)
        if self.device.type == "cuda":  # CUDA graphs: the buffers keep their addresses
            # (only there: importing torch._dynamo takes seconds, and a CPU has no graphs to capture)
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer)

    def buffers(self):
        """Every tensor the steps update in place (their shapes never change)."""
        found = [self._position]
        for ring in self.rings:
            found.append(ring.positions)
        for pair in self.blocks:
            for branch in pair:
                found.extend(branch.buffers())
        return found

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

    def ring(self, window, cache):
        """The index of the shared slot bookkeeping of ``window`` (created from the first
        layer's cache) in the step's list of (slot, bias)."""
        if window not in self.windows:
            self.windows.append(window)
            self.rings.append(_Ring(window, cache, self.batch, self.device))
        return self.windows.index(window)

    def seen_from(self, blindspot_size):
        """The position from which every row's query sees a key of the global heads: the
        block after each row's first real token (with ``blindspot_size`` 1, its own key)."""
        if blindspot_size == 1:
            return 0
        return (self.first_real // blindspot_size + 1) * blindspot_size

    def block(self, blindspot_size):
        """The index of a blindspot size's (slot, joining) (``BlockHeads.step``) in the step's list."""
        if blindspot_size not in self.block_sizes:
            self.block_sizes.append(blindspot_size)
        return self.block_sizes.index(blindspot_size)

    def join(self, blindspot_size, dtype, exp_features):
        """The index of a blindspot's join flags (``_join_flags``) in the step's list."""
        for i, (size, dt, exp, _, _) in enumerate(self.joins):
            if (size, dt, exp) == (blindspot_size, dtype, exp_features):
                return i
        zero = torch.zeros((), dtype=dtype, device=self.device)
        self.joins.append((blindspot_size, dtype, exp_features, zero, torch.full_like(zero, NEG_INF)))
        return len(self.joins) - 1

    @property
    def position(self):
        if self._host_position is None:  # compiled steps ran: read the device's count once
            self._host_position = int(self._position)
        return self._host_position

    def step(self, tokens):
        _check_step_tokens(tokens, self.batch)
        if torch.compiler.is_compiling():
            # no host count under compile (a Python int that changes would recompile): the
            # device checks, and an eager step after this reads the position back
            self._host_position = None
            torch._assert_async(self._position < self.max_seq_len,
                                "decoder step past max_seq_len: sequence length exceeds max_seq_len")
            with torch.no_grad():
                return self._advance(tokens)
        p = self.position
        if p >= self.max_seq_len:
            raise ValueError(f"sequence length {p + 1} exceeds max_seq_len={self.max_seq_len}")
        # under autocast the form a compiled step traces (its F.linear casts; the eager form
        # writes into buffers of the model's dtype)
        host = None if torch.is_autocast_enabled(self.device.type) else p
        threads, saved = self.step_threads, None
        if threads is not None and torch.get_num_threads() != threads:
            saved = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            if torch.is_inference_mode_enabled():  # (generate runs in it: no context to enter)
                out = self._advance(tokens, host)
            else:
                with torch.inference_mode():
                    out = self._advance(tokens, host)
        finally:
            if saved is not None:
                torch.set_num_threads(saved)
        self._host_position = p + 1
        return out

    def _advance(self, tokens, host_position=None):
        """One step on tensors only: nothing here reads a value back. Only ``host_position``
        (eager steps: the position as the host counts it, equal to the device's) is a Python
        number. It spares eager steps work that a compiled step does as tensor operations (and
        fuses): a blindspot's join on the steps that do not complete a block (the join's flags
        would make it a no-op), the ring's slot arithmetic, and the position embedding's
        lookup (a view of the table)."""
        p = self._position
        windows = [ring.advance(p, host_position) for ring in self.rings]
        if host_position is None:
            joins = [_join_flags(p, *join) for join in self.joins]
            blocks = [(torch.remainder(p, size)[None], torch.remainder(p + 1, size) == 0) for size in self.block_sizes]
        else:
            joins = [_joining(*join) if (host_position + 1) % join[0] == 0 else None for join in self.joins]
            blocks = [(host_position % size, (host_position + 1) % size == 0) for size in self.block_sizes]
        rotary = None if self.rotary is None else self.rotary(p[None])
        ctx = _StepContext(windows, joins, blocks, rotary, host_position)
        x = self.embedding(tokens, p, host_position)
        if self.reversible:
            x1 = x2 = x
            for f, g in self.blocks:
                y1 = x1 + f(x2, ctx)
                x2 = x2 + g(y1, ctx)
                x1 = y1
            x = (x1 + x2) / 2
        elif host_position is None:
            for f, g in self.blocks:
                x = x + f(x, ctx)
                x = x + g(x, ctx)
        else:  # each branch adds its output to x in place (x is this step's own tensor)
            for f, g in self.blocks:
                f(x, ctx, x)
                g(x, ctx, x)
        p.add_(1)
        return self.embedding.logits(x)


class _StepContext:
    """What one step's layers share: per ring its (slot, bias (b, 1, slots)), per blindspot
    its join flags (GlobalHeads) and its (slot, joining) (BlockHeads) (lists, indexed as
    ``Decoder.rings`` / ``Decoder.joins`` / ``Decoder.block_sizes``), and the rotary (cos,
    sin) of the position; and the position as an int on eager steps, else None."""

    __slots__ = ("windows", "joins", "blocks", "rotary", "host_position")

    def __init__(self, windows, joins, blocks, rotary, host_position):
        self.windows, self.joins, self.blocks, self.rotary = windows, joins, blocks, rotary
        self.host_position = host_position


def _join_flags(p, blindspot_size, dtype, exp_features, zero, hidden):
    """Whether the token at position p completes its blindspot block, as the factors the join
    uses: (flag, 1 - flag) with given features, (log flag, log(1 - flag)) (0 or -inf) with
    exponential ones; ``zero`` and ``hidden`` are 0 and -inf in ``dtype``."""
    joining = torch.remainder(p + 1, blindspot_size) == 0
    if exp_features:
        return torch.where(joining, zero, hidden), torch.where(joining, hidden, zero)
    flag = joining.to(dtype)
    return flag, 1 - flag


def _joining(blindspot_size, dtype, exp_features, zero, hidden):
    """The flags of ``_join_flags`` at a position that completes its block."""
    return (zero, hidden) if exp_features else (1 - zero, zero)


class _Embedding:
    """Token and position embeddings in, logits out, for one position at a time.

    The position embeddings of every position are computed once by the model's own module
    (the general form's numbers) when the table has at most ``POSITION_TABLE_ELEMENTS``
    entries; a longer one is not kept, and each step calls the module on its position."""

    def __init__(self, model, device):
        self.token = model.token_emb.weight
        self.pos_emb = model.pos_emb
        self.table = None
        if self.pos_emb is not None and model.max_seq_len * self.token.shape[1] <= POSITION_TABLE_ELEMENTS:
            positions = torch.arange(model.max_seq_len, device=device)
            self.table = self.pos_emb(positions).to(self.token.dtype)
            self.table_rows = self.table.unbind(0)  # (eager steps: a row without an indexing op)
        self.project_in = None if isinstance(model.project_in, nn.Identity) else model.project_in
        self.norm = model.norm
        self.project_out = None if isinstance(model.project_out, nn.Identity) else model.project_out
        self.to_logits = model.to_logits

    def __call__(self, tokens, p, host_position=None):
        h = F.embedding(tokens, self.token)
        if self.table is not None:
            # (a tensor index is an embedding lookup: indexing with it would read it back)
            h = h + (F.embedding(p, self.table) if host_position is None else self.table_rows[host_position])
        elif self.pos_emb is not None:
            h = h + self.pos_emb(p[None]).to(h.dtype)
        if self.project_in is not None:
            h = F.linear(h, self.project_in.weight, self.project_in.bias)
        return h

    def logits(self, x):
        norm = self.norm
        x = torch.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        if self.to_logits is None:  # return_embeddings
            return x
        if self.project_out is not None:
            x = F.linear(x, self.project_out.weight, self.project_out.bias)
        return F.linear(x, self.to_logits.weight, self.to_logits.bias)


class _BranchStep:
    """LayerNorm, token shift (the previous token's normalised features kept), then the step.
    Called with ``into`` (eager steps of a model that is not reversible), the branch's output
    is added to ``into`` in place (the residual stream, a tensor of this step's own)."""

    __slots__ = ("norm_args", "shift_sizes", "previous", "step")

    def __init__(self, branch, previous, step):
        norm = branch.norm
        self.norm_args = (norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        self.shift_sizes = self.previous = None
        if branch.shifts is not None:
            if tuple(branch.shifts) != (1, 0):
                raise ValueError(f"a causal decoder shifts by (1, 0), got {branch.shifts}")
            dim = norm.normalized_shape[0]
            self.shift_sizes = (dim // 2, dim - dim // 2)
            self.previous = previous.clone()  # (b, dim), overwritten by every step
        self.step = step

    def buffers(self):
        return ([] if self.previous is None else [self.previous]) + self.step.buffers()

    def __call__(self, x, ctx, into=None):
        h = torch.layer_norm(x, *self.norm_args)
        if self.shift_sizes is not None:
            # slice 0 comes from the token before, slice 1 stays (token_shift.shift_tokens)
            shifted = torch.cat((self.previous[:, : self.shift_sizes[0]], h[:, self.shift_sizes[0]:]), dim=-1)
            self.previous.copy_(h)
            h = shifted
        return self.step(h, ctx, into)


class _FeedForwardStep:
    __slots__ = ("in_weight", "in_bias", "out_weight", "out_weight_t", "out_bias", "glu", "activation")

    def __init__(self, ff):
        self.in_weight, self.in_bias = ff.proj_in.weight, ff.proj_in.bias
        self.out_weight, self.out_bias = ff.proj_out.weight, ff.proj_out.bias
        self.out_weight_t = self.out_weight.t()
        self.glu, self.activation = ff.glu, ff.activation

    def buffers(self):
        return []

    def __call__(self, h, ctx, into=None):
        h = F.linear(h, self.in_weight, self.in_bias)
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * self.activation(gate)
        else:
            h = self.activation(h)
        if into is None:
            return F.linear(h, self.out_weight, self.out_bias)
        return into.addmm_(h, self.out_weight_t).add_(self.out_bias)


class _ModuleStep:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def buffers(self):
        return []

    def __call__(self, h, ctx, into=None):
        out = self.fn(h[:, None])[:, 0]
        return out if into is None else into.add_(out)


class _ContextStep:
    """Cross-attention: the context was reduced to kᵀv on the first call; read it."""

    __slots__ = ("attn", "cache")

    def __init__(self, attn, cache):
        self.attn, self.cache = attn, cache

    def buffers(self):
        return []

    def __call__(self, h, ctx, into=None):
        out = self.attn(h[:, None], cache=self.cache)[:, 0]
        return out if into is None else into.add_(out)


class _Ring:
    """Slots of a local window's ring buffer: key position t sits in slot t mod size.

    ``size`` is the most keys a query can see ((look_backward + 1) * w, or look_backward * w
    with ``exact``). ``positions`` (b, size) holds each slot's key position per row (``NO_KEY``
    for a slot without a real key). Entering position p (``advance``) writes p into its slot
    and returns the slot and the bias (b, 1, size): 0 on the slots whose key the query sees
    (``Window.visible``: a causal window of stored keys, all at positions <= p, sees those
    from its first key on), -inf on the others."""

    def __init__(self, window, cache, batch, device):
        w, L = window.size, window.look_backward
        if not window.causal:
            raise ValueError("a decoder's local window must be causal")
        self.window = window
        self.size = size = L * w if window.exact else (L + 1) * w
        self.dtype = dtype = cache.keys.dtype
        self.positions = torch.full((batch, size), NO_KEY, dtype=torch.long, device=device)
        m = cache.keys.shape[2]
        if m:
            keys = torch.arange(cache.start, cache.start + m, device=device)
            self.positions[:, self.slots_of(cache.start, m)] = torch.where(cache.mask, keys, NO_KEY)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.hidden = torch.full((), NEG_INF, dtype=dtype, device=device)
        # from ``steady`` on every slot holds a real key at a position >= 0, and which slots a
        # query sees depends on its slot alone: ``table`` (size, 1, 1, size) holds that bias
        padded = (~cache.mask).any(dim=0).nonzero() if m else []
        padded_until = cache.start + int(padded[-1]) if len(padded) else -1  # (built once: a sync is fine)
        self.steady_from = max(size, padded_until + size + 1)
        self.steady = torch.tensor(self.steady_from, device=device)
        q = size + torch.arange(size, device=device)[:, None]  # one query per residue mod size
        slot_positions = q - (q - torch.arange(size, device=device)) % size
        self.table = torch.where(window.visible(q, slot_positions), self.zero, self.hidden)[:, None, None]
        # eager steps' views: the bias row and the positions' column of each slot
        self.table_rows, self.position_slots = self.table.unbind(0), self.positions.unbind(1)

    def slots_of(self, start, count):
        return torch.arange(start, start + count, device=self.positions.device) % self.size

    def advance(self, p, host_position=None):
        """Enter position p (a long tensor of no dimension; ``host_position``: the same as an
        int, or None): (slot, bias (b or 1, 1, size)); the slot is an int on eager steps (the
        host knows it), else a long tensor (1,)."""
        w, L, exact = self.window.size, self.window.look_backward, self.window.exact
        if host_position is not None:  # eager: the slot, and from steady on the bias, from the host
            slot = host_position % self.size
            if host_position >= self.steady_from:  # (the positions are not read again)
                return slot, self.table_rows[slot]
            self.position_slots[slot].copy_(p)
            first = host_position - (L * w - 1) if exact else (host_position // w - L) * w
            return slot, torch.where(self.positions >= first, self.zero, self.hidden)[:, None]
        slot = torch.remainder(p, self.size)[None]
        # the window's first key: p - L w + 1 (exact), else the start of the block L blocks back
        first = p - (L * w - 1) if exact else p - torch.remainder(p, w) - L * w
        self.positions.index_copy_(1, slot, p.expand(self.positions.shape[0], 1))
        bias = torch.where(self.positions >= first, self.zero, self.hidden)[:, None]
        # (eager steps from steady on did not write the positions)
        return slot, torch.where(p >= self.steady, self.table.index_select(0, slot)[0], bias)


class GlobalHeads:
    """The recurrent state of one layer's global heads, stepped in place.

    kv (b, h, d, e + 1) with the normaliser as its last column, ref (b, h, d) its per-feature
    log reference (exponential features; else None), and with a blindspot pending /
    pending_ref: the same for the keys of the unfinished block (``CausalState``'s fields,
    copied: the given tensors are not modified). ``step`` is ``causal_linear_attention_step``
    (same math, same references) on these buffers."""

    def __init__(self, kv, ref, pending, pending_ref, blindspot_size, exp_features):
        self.kv = kv.clone()
        self.ref = None if ref is None else ref.clone()
        self.pending = None if pending is None else pending.clone()
        self.pending_ref = None if pending_ref is None else pending_ref.clone()
        self.blindspot_size, self.exp_features = blindspot_size, exp_features
        if (blindspot_size > 1) != (pending is not None) or exp_features != (ref is not None):
            raise ValueError("the state does not match blindspot_size / exp_features")

    @classmethod
    def from_state(cls, state, blindspot_size, exp_features):
        return cls(state.kv, state.ref, state.pending, state.pending_ref, blindspot_size, exp_features)

    def buffers(self):
        return [t for t in (self.kv, self.ref, self.pending, self.pending_ref) if t is not None]

    def step(self, q, k, v, log_decay=None, join=None, all_seen=False, out=None):
        """q, k (b, h, d) features (logits with exponential features), v (b, h, e), in the
        state's dtype; log_decay None, (b, h) or (b, h, d). With a blindspot, ``join`` is
        ``_join_flags`` of this position, or None where the caller knows that the position
        does not complete its block. ``all_seen``: the caller knows that every row's query sees
        a key (see ``read_state``). Returns out (b, h, e) (written into ``out`` when given);
        every token is real."""
        kv, ref, pending, pending_ref = self.kv, self.ref, self.pending, self.pending_ref
        exp_features, blindspot = self.exp_features, self.blindspot_size > 1
        v1 = F.pad(v, (0, 1), value=1.0)[:, :, None, :]  # the normaliser's column of ones
        if log_decay is not None:
            ld = log_decay[..., None] if log_decay.ndim == 2 else log_decay  # (b, h, 1 or d)
            if exp_features:  # the decay moves the references, not the sums
                ref.add_(ld)
                if blindspot:
                    pending_ref.add_(ld)
            else:
                a = ld.exp()[..., None]
                kv.mul_(a)
                if blindspot:
                    pending.mul_(a)
        acc, acc_ref = (pending, pending_ref) if blindspot else (kv, ref)
        if exp_features:
            # a key moves the reference to max(ref, k): factors exp(ref - new) <= 1 and
            # exp(k - new) <= 1, so the largest term stays 1 (ref -inf: no key yet, factor 0)
            new_ref = torch.maximum(acc_ref, k)
            acc.mul_((acc_ref - new_ref).exp()[..., None]).addcmul_((k - new_ref).exp()[..., None], v1)
            acc_ref.copy_(new_ref)
        else:
            acc.addcmul_(k[..., None], v1)
        out = read_state(q, kv, ref, exp_features, all_seen, out)
        if blindspot and join is not None:
            self._join(*join)
        return out

    def _join(self, a, b):
        """The blindspot block's keys join the state when (a, b) = (1, 0) (log: (0, -inf)), and
        (0, 1) ((-inf, 0)) leaves both exactly as they were."""
        kv, ref, pending, pending_ref = self.kv, self.ref, self.pending, self.pending_ref
        if not self.exp_features:
            kv.addcmul_(pending, a)
            pending.mul_(b)
            return
        joining_ref = pending_ref + a  # -inf unless the block joins now
        new_ref = torch.maximum(ref, joining_ref)
        kv.mul_(_exp_ratio(ref, new_ref)[..., None]).addcmul_(pending, _exp_ratio(joining_ref, new_ref)[..., None])
        ref.copy_(new_ref)
        # after a join pending_ref is -inf, so the next key's rescale (factor exp(-inf) = 0)
        # empties pending
        pending_ref.add_(b)


class BlockHeads:
    """The recurrent state of one layer's global heads with a blindspot and no decay, stepped
    in place: the keys and values of the unfinished block wait, as they are, in a buffer of
    ``blindspot_size`` slots (the key at position t in slot t mod size), and join the state
    all at once when the block is complete.

    A step then writes its key and value and reads the state; ``GlobalHeads`` updates the
    block's sum at every step (8 more operations on the state's shape). kv / ref as in
    ``GlobalHeads``; pending / pending_ref hold what the prompt added to the first block
    (the cache keeps the sum of those keys, not the keys). A slot without a key holds key
    -inf (exponential features) or 0, and value 0: it adds nothing to a join."""

    def __init__(self, kv, ref, pending, pending_ref, blindspot_size, exp_features):
        if blindspot_size < 2 or pending is None or exp_features != (ref is not None):
            raise ValueError("the state does not match blindspot_size / exp_features")
        self.kv, self.pending = kv.clone(), pending.clone()
        self.ref = self.pending_ref = None
        if exp_features:
            self.ref, self.pending_ref = ref.clone(), pending_ref.clone()
        self.blindspot_size, self.exp_features = blindspot_size, exp_features
        b, h, d, e1 = kv.shape
        self.keys = kv.new_full((b, h, blindspot_size, d), NEG_INF if exp_features else 0.0)
        self.values = kv.new_zeros(b, h, blindspot_size, e1)
        self.values[..., -1] = 1.0  # the normaliser's column of ones
        # eager steps write a slot through these views (b, h, d) / (b, h, e)
        self.key_slots, self.value_slots = self.keys.unbind(2), self.values[..., :-1].unbind(2)

    @classmethod
    def from_state(cls, state, blindspot_size, exp_features):
        return cls(state.kv, state.ref, state.pending, state.pending_ref, blindspot_size, exp_features)

    def buffers(self):
        return [t for t in (self.kv, self.ref, self.pending, self.pending_ref, self.keys, self.values) if t is not None]

    def step(self, q, k, v, slot, joining, all_seen=False, out=None):
        """q, k (b, h, d) features (logits with exponential features), v (b, h, e), in the
        state's dtype, at a position whose slot is ``slot`` (position mod blindspot_size). On
        eager steps ``slot`` is an int and ``joining`` a bool: whether this position completes
        its block. Else ``slot`` is a long tensor (1,) and ``joining`` a bool tensor of no
        dimension, and every step computes the join and keeps it where ``joining`` holds.
        Returns out (b, h, e) (the query does not see its own block), written into ``out``
        when given."""
        if isinstance(slot, int):
            self.key_slots[slot].copy_(k)
            self.value_slots[slot].copy_(v)
        else:
            self.keys.index_copy_(2, slot, k[:, :, None])
            self.values[..., :-1].index_copy_(2, slot, v[:, :, None])
        out = read_state(q, self.kv, self.ref, self.exp_features, all_seen, out)
        if joining is True:
            self._join()
        elif joining is not False:
            self._join(joining)
        return out

    def _join(self, joining=None):
        """The block's keys join the state (``_complete_block`` of the block's sum): at once
        when ``joining`` is None, else where the bool tensor ``joining`` holds (``torch.where``:
        elsewhere every buffer keeps its values bit for bit)."""
        kv, ref, pending, pending_ref = self.kv, self.ref, self.pending, self.pending_ref
        keys = self.keys
        if self.exp_features:
            # the block's reference is the largest of its keys (the current one is finite)
            new_ref = torch.maximum(ref, torch.maximum(pending_ref, keys.amax(dim=2)))
            weights = (keys - new_ref[:, :, None]).exp()  # (b, h, slots, d); -inf keys give 0
            earlier = kv * _exp_ratio(ref, new_ref)[..., None] + pending * _exp_ratio(pending_ref, new_ref)[..., None]
        else:
            weights, earlier = keys, kv + pending
        joined = earlier + weights.transpose(-1, -2) @ self.values
        if joining is None:
            kv.copy_(joined)
            if self.exp_features:
                ref.copy_(new_ref)
                pending_ref.fill_(NEG_INF)  # (pending then adds nothing: its factor is 0)
            else:
                pending.zero_()
            return
        kv.copy_(torch.where(joining, joined, kv))
        if self.exp_features:
            ref.copy_(torch.where(joining, new_ref, ref))
            pending_ref.copy_(torch.where(joining, NEG_INF, pending_ref))
        else:
            pending.copy_(torch.where(joining, 0.0, pending))


def _exp_ratio(a, b):
    """exp(a - b) for references a <= b that may be -inf (no key yet): 0 when a is -inf."""
    return (a - b).exp().nan_to_num(nan=0.0)


def read_state(q, kv, ref, exp_features, all_seen=False, out=None):
    """A query reads a state: q (b, h, d), kv (b, h, d, e + 1) relative to ref (b, h, d) (or
    None) -> (b, h, e), written into ``out`` when given. With exponential features the
    query's factors are exp(q + ref - M), M = max_d (q_d + ref_d): the largest is 1, so the
    denominator is >= 1 once a key is seen; before any key (ref all -inf) every factor is 0
    and so is the output. With given (non-negative) features a denominator of 0 means no key
    was seen, and the output is 0. ``all_seen``: the caller knows that every row has seen a
    key (exponential features: the factors are then a softmax, whose sum cancels in the
    ratio, and the guards against a row without a key are left out; they change nothing)."""
    if not exp_features:  # (products and sums rather than a batched matmul: see _AttentionStep._local)
        num = (q[..., None] * kv).sum(dim=-2)
        den = num[..., -1:]
        return torch.div(num[..., :-1], torch.where(den > 0, den, 1.0), out=out)
    if all_seen:
        num = (torch.softmax(q + ref, dim=-1)[..., None] * kv).sum(dim=-2)
        return torch.div(num[..., :-1], num[..., -1:], out=out)
    logits = q + ref
    # a row before any key: ref and top are -inf; a finite top gives 0 / 0 -> 0 / 1
    top = logits.amax(dim=-1, keepdim=True).clamp(min=-torch.finfo(logits.dtype).max)
    num = ((logits - top).exp()[..., None] * kv).sum(dim=-2)
    return torch.div(num[..., :-1], num[..., -1:].clamp(min=1.0), out=out)


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
        self.weight = torch.cat(weights, dim=0)
        # the local heads' queries come out of the projection already scaled by dim_head^-1/2
        # (rotary is a rotation: it commutes with the scale)
        self.weight[: attn.n_local * dh] *= dh ** -0.5
        self.bias = None
        if out_gate is not None:  # only the output gate has a bias: the others add exact zeros
            self.bias = torch.cat((self.weight.new_zeros(sum(sizes[:-1])), out_gate.gate_out.bias))
        self.ends = torch.tensor(sizes).cumsum(0).tolist()
        self.to_out, self.gate, self.out_gate = attn.to_out, gate, out_gate
        self.rotary = decoder.rotary is not None
        b = decoder.batch

        self.ring_kv = self.state = self.conv = None
        if nl:
            local = cache.local
            self.window = decoder.ring(attn.local_window, local)
            ring = decoder.rings[self.window]
            # keys and values of the local heads: (b, 2, local heads, slots, dh)
            self.ring_kv = torch.zeros(b, 2, nl, ring.size, dh, dtype=local.keys.dtype, device=local.keys.device)
            m = local.keys.shape[2]
            if m:
                slots = ring.slots_of(local.start, m)
                self.ring_kv[:, 0, :, slots] = local.keys
                self.ring_kv[:, 1, :, slots] = local.values
            # eager steps' views: each slot's (b, 2, local heads, dh), and the keys and values
            self.ring_slots = self.ring_kv.unbind(3)
            self.ring_keys, self.ring_values = self.ring_kv.unbind(1)
        if ng:
            blindspot = attn.blindspot_size
            self.exp_features = attn.feature_map.is_softmax
            self.feature_map = attn.feature_map
            state = cache.global_.state
            self.block = self.join = None
            if blindspot > 1 and gate is None:  # the block's keys wait as they are (BlockHeads)
                self.state = BlockHeads.from_state(state, blindspot, self.exp_features)
                self.block = decoder.block(blindspot)
            else:
                self.state = GlobalHeads.from_state(state, blindspot, self.exp_features)
                if blindspot > 1:
                    self.join = decoder.join(blindspot, state.kv.dtype, self.exp_features)
            self.state_dtype = state.kv.dtype
            self.seen_from = decoder.seen_from(blindspot)
            if attn.local_conv is not None:
                # the three convolutions (q, k, v) as one: weights (3, global heads, taps, dh)
                self.conv_weight = torch.stack(
                    [c.conv_weight.reshape(ng, dh, c.kernel_size).transpose(1, 2) for c in attn.local_conv]
                )
                self.conv = torch.stack(cache.global_.conv, dim=1)  # (b, 3, global heads, taps - 1, dh)
            if gate is not None:
                self.gate_up, self.gate_per_head = gate.gate_up, gate.granularity == "head"
                self.temperature = gate.temperature
        self._eager_buffers(attn, b)

    def _eager_buffers(self, attn, batch):
        """What eager steps write into and read through, made once: the projection's output
        and views of its parts, and the heads' outputs (b, heads * dh + 1) with a last column
        of ones, so that the output projection's bias is one more weight column and a single
        ``addmm_`` adds the branch to the residual stream."""
        b, heads, dh, kvh, nl = batch, self.heads, self.dim_head, self.kv_heads, self.n_local
        q_end, kv_end = self.ends[0], self.ends[1]
        self.weight_t = self.weight.t()
        self.proj = proj = self.weight.new_empty(b, self.weight.shape[0])
        self.parts = None  # (q local (b, nl, 1, dh), kv local (b, 2, nl, dh), q, k, v global (b, ng, dh))
        if not self.rotary and kvh == heads:  # the parts are views of the projection
            q, kv = proj[:, :q_end].view(b, heads, dh), proj[:, q_end:kv_end].view(b, 2, heads, dh)
            self.parts = (q[:, :nl, None], kv[:, :, :nl], q[:, nl:], kv[:, 0, nl:], kv[:, 1, nl:])
        self.gate_in = None if self.gate is None else proj[:, kv_end : self.ends[2]]
        self.out_gate_in = None if self.out_gate is None else proj[:, self.ends[-2]:]
        self.heads_out = proj.new_ones(b, heads * dh + 1)
        self.heads_flat = self.heads_out[:, :-1]
        heads_view = self.heads_flat.view(b, heads, dh)
        self.out_local, self.out_global = heads_view[:, :nl], heads_view[:, nl:]
        to_out = attn.to_out
        self.out_weight_t = torch.cat((to_out.weight, to_out.bias[:, None]), dim=1).t()

    def buffers(self):
        found = [t for t in (self.ring_kv, self.conv) if t is not None]
        return found + ([] if self.state is None else self.state.buffers())

    def _split(self, proj, rotary):
        """The projection (b, width) -> (q local (b, nl, 1, dh), kv local (b, 2, nl, dh), q, k,
        v global (b, ng, dh) each): views, unless rotary or kv_heads make new tensors."""
        b, heads, dh, kvh, nl = proj.shape[0], self.heads, self.dim_head, self.kv_heads, self.n_local
        q_end, kv_end = self.ends[0], self.ends[1]
        if self.rotary:  # q and k are side by side: rotate them at once
            qk = apply_rotary(proj[:, : q_end + kvh * dh].view(b, heads + kvh, dh), rotary)
            q = qk[:, :heads]
            kv = torch.stack((qk[:, heads:], proj[:, q_end + kvh * dh : kv_end].view(b, kvh, dh)), dim=1)
        else:
            q = proj[:, :q_end].view(b, heads, dh)
            kv = proj[:, q_end:kv_end].view(b, 2, kvh, dh)
        if kvh != heads:
            kv = kv.repeat_interleave(heads // kvh, dim=2)
        return q[:, :nl, None], kv[:, :, :nl], q[:, nl:], kv[:, 0, nl:], kv[:, 1, nl:]

    def __call__(self, h, ctx, into=None):
        """The branch's output for h (b, dim); with ``into`` (eager steps) added to it in place."""
        if ctx.host_position is None:
            return self._traced(h, ctx)
        proj = self.proj
        if self.bias is None:
            torch.mm(h, self.weight_t, out=proj)
        else:
            torch.addmm(self.bias, h, self.weight_t, out=proj)
        q_local, kv_local, q, k, v = self.parts if self.parts is not None else self._split(proj, ctx.rotary)
        if self.n_local:
            out = self._local(q_local, kv_local, ctx, self.out_local)
            if out is not self.out_local:
                self.out_local.copy_(out)
        if self.n_global:
            log_gate = None if self.gate is None else self._log_gate(self.gate_in)
            out = self._global(q, k, v, log_gate, ctx, self.out_global)
            if out is not self.out_global:
                self.out_global.copy_(out)
        if self.out_gate is not None:
            self.heads_flat.mul_(torch.sigmoid(self.out_gate_in))
        if into is None:
            return torch.mm(self.heads_out, self.out_weight_t)
        return into.addmm_(self.heads_out, self.out_weight_t)

    def _traced(self, h, ctx):
        """The step as a compiled step traces it: new tensors, no buffer but the state's."""
        b = h.shape[0]
        proj = F.linear(h, self.weight, self.bias)
        q_local, kv_local, q, k, v = self._split(proj, ctx.rotary)
        outs = []
        if self.n_local:
            outs.append(self._local(q_local, kv_local, ctx))
        if self.n_global:
            log_gate = None if self.gate is None else self._log_gate(proj[:, self.ends[1] : self.ends[2]])
            outs.append(self._global(q, k, v, log_gate, ctx))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = out.reshape(b, self.heads * self.dim_head)
        if self.out_gate is not None:
            out = out * torch.sigmoid(proj[:, self.ends[-2]:])
        return F.linear(out, self.to_out.weight, self.to_out.bias)

    def _local(self, q, kv, ctx, out=None):
        """q (b, nl, 1, dh) (scaled), kv (b, 2, nl, dh) -> (b, nl, dh), written into ``out``
        when given."""
        slot, bias = ctx.windows[self.window]
        if isinstance(slot, int):  # eager: through the views made once
            self.ring_slots[slot].copy_(kv)
            keys, values = self.ring_keys, self.ring_values
        else:  # (views of the buffer made here: a compiled step's inputs do not alias)
            self.ring_kv.index_copy_(3, slot, kv[:, :, :, None])
            keys, values = self.ring_kv.unbind(1)
        # products and sums, not matmuls: a batched matmul of these tiny shapes runs on every
        # thread, and on a busy machine waiting for the other threads costs milliseconds
        sim = (q * keys).sum(dim=-1) + bias  # (b, h, slots)
        return torch.sum(sim.softmax(dim=-1)[..., None] * values, dim=-2, out=out)  # the query sees its own key

    def _log_gate(self, down):
        logits = F.linear(down, self.gate_up.weight, self.gate_up.bias)
        log_a = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))) / self.temperature
        return log_a if self.gate_per_head else log_a.view(log_a.shape[0], self.n_global, self.dim_head)

    def _global(self, q, k, v, log_gate, ctx, out=None):
        """The global heads' output (b, ng, dh), written into ``out`` when given and of the
        state's dtype."""
        if self.conv is not None:
            window = torch.cat((self.conv, torch.stack((q, k, v), dim=1)[:, :, :, None]), dim=3)
            self.conv.copy_(window[:, :, :, 1:])  # the raw inputs, for the next steps
            q, k, v = (window * self.conv_weight).sum(dim=3).unbind(1)
        if not self.exp_features:
            q, k = self.feature_map._pointwise(q), self.feature_map._pointwise(k)
        dtype = out_dtype = q.dtype
        if dtype != self.state_dtype:
            dtype, out = self.state_dtype, None
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            log_gate = None if log_gate is None else log_gate.to(dtype)
        seen = ctx.host_position is not None and ctx.host_position >= self.seen_from
        if self.block is not None:
            out = self.state.step(q, k, v, *ctx.blocks[self.block], seen, out=out)
        else:
            join = None if self.join is None else ctx.joins[self.join]
            out = self.state.step(q, k, v, log_gate, join, seen, out=out)
        return out if out.dtype == out_dtype else out.to(out_dtype)
