"""Fast decoding: a running decoder that takes one token per row per step.

``Decoder`` is the loop of ``AutoregressiveWrapper.generate``: primed once with the prompt
(``start_decoding``: the model's cached path), then ``step(tokens)`` feeds one token per row
and returns the next logits. It keeps only the loop: the position, the thread count of an
eager step, and on CUDA the buffers' static addresses. Each layer steps itself
(``model.step_of``: ``LMStep``, ``BranchStep``, ``AttentionStep`` and the pieces' steps beside
their full forms) on the cache's buffers, in place: the decoder's state *is* the cache.

The position is a tensor on the model's device, advanced in place, and every choice that
follows from it is a tensor operation: a step reads nothing back to the host, allocates
nothing that lasts, and ``torch.compile(decoder.step, fullgraph=True)`` traces one graph for
every position (``mode="reduce-overhead"``: a CUDA graph, the buffers marked static). Eager
steps also know the position on the host and use it where it saves work. A model with a layer
that has no step (``attend_axially``) gets ``CacheDecoder``, the same interface over the
cached path.
"""

from __future__ import annotations

import torch

from .attention import Attention
from .ops.segments import check_integer_ids

__all__ = ["Decoder", "CacheDecoder", "start_decoding"]

# eager steps on a CPU for at most this many rows run on one thread (Decoder.step_threads)
ONE_THREAD_MAX_BATCH = 8


def start_decoding(model, x, input_mask=None, context=None, context_mask=None):
    """Prime a decoder with the prompt ``x`` (b, n). Returns (logits (b, num_tokens) at the
    prompt's last position, ``Decoder``, or ``CacheDecoder`` when a layer has no step)."""
    # not in inference mode: the buffers are then ordinary tensors, updatable in place in any mode
    with torch.no_grad():
        out, cache = model._body(x, input_mask, context, context_mask, None, True)
        logits = model._output(out[:, -1])
        if not Decoder.supports(model):
            return logits, CacheDecoder(model, cache)
        return logits, Decoder(model, cache, x.shape[0], input_mask)


class CacheDecoder:
    """The decoder interface over the cached path: ``step`` calls
    ``model(tokens[:, None], cache=cache, return_cache=True)`` (not one graph)."""

    compilable = False

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    @property
    def position(self):
        return self.cache.position

    @torch.inference_mode()
    def step(self, tokens):
        return self.model(tokens[:, None], cache=self.cache, return_cache=True)[0][:, -1]


class Decoder:
    """One running sequence per row (see the module docstring), built by ``start_decoding``.

    It owns and steps its prompt's ``DecodingCache`` (``decoder.cache``: clone it to keep a
    copy); the attention layers' projection weights are concatenated when it is built, so
    parameters changed afterwards are not seen. ``step(tokens (b,) integer) -> logits (b,
    num_tokens)``; ``max_seq_len`` is checked on the host eagerly, on the device compiled.
    ``position``: tokens consumed (prompt included). ``step_threads``: the torch thread count
    of an eager step (None: torch's own); on a CPU 1 for at most ``ONE_THREAD_MAX_BATCH`` rows:
    a step's small operations gain nothing from a second thread and wait for it when another
    process holds the core (benchmarks/README.md).
    """

    compilable = True  # (AutoregressiveWrapper.generate's compile_step)

    @staticmethod
    def supports(model):
        """Whether every branch of ``model`` (an LM) has a step."""
        branches = [branch for pair in model.transformer.layers.blocks for branch in pair]
        return all(isinstance(branch.fn, Attention) or not branch.stateful for branch in branches)

    def __init__(self, model, cache, batch, input_mask=None):
        self.batch, self.max_seq_len = batch, model.max_seq_len
        self.device = device = model.token_emb.weight.device
        self.step_threads = 1 if device.type == "cpu" and batch <= ONE_THREAD_MAX_BATCH else None
        # the latest first real token over the rows (prompts are padded on the left)
        first_real = 0
        if input_mask is not None:  # (a row without any: its first generated token; built once: a sync is fine)
            first = torch.where(input_mask.any(dim=1), input_mask.int().argmax(dim=1), input_mask.shape[1])
            first_real = int(first.max())
        self._cache = cache
        self._steps = model.step_of(cache, batch, first_real)
        # the position: on the device for the step, and on the host for eager steps' check
        self._position = torch.tensor(cache.position, dtype=torch.long, device=device)
        self._host_position = cache.position
        if device.type == "cuda":  # CUDA graphs: the buffers keep their addresses
            # (only there: importing torch._dynamo takes seconds, and a CPU has no graphs to capture)
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer)

    def buffers(self):
        """Every tensor the steps update in place (their shapes never change)."""
        return [self._position] + self._steps.buffers()

    @property
    def position(self):
        if self._host_position is None:  # compiled steps ran: read the device's count once
            self._host_position = int(self._position)
        return self._host_position

    @property
    def cache(self):
        """The ``DecodingCache`` this decoder steps (its positions brought up to date)."""
        self._cache.set_position(self.position)
        for ring in self._steps.rings():
            ring.settle(self.position)
        return self._cache

    def step(self, tokens):
        check_integer_ids(tokens, "tokens")
        if tokens.dtype != torch.int64:  # (any integer dtype: the embedding takes int64)
            tokens = tokens.long()
        if tuple(tokens.shape) != (self.batch,):
            raise ValueError(f"tokens must have shape ({self.batch},): one token per row, got {tuple(tokens.shape)}")
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
        threads, saved = self.step_threads, None
        if threads is not None and torch.get_num_threads() != threads:
            saved = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            if torch.is_inference_mode_enabled():  # (generate runs in it: no context to enter)
                out = self._advance(tokens, p)
            else:
                with torch.inference_mode():
                    out = self._advance(tokens, p)
        finally:
            if saved is not None:
                torch.set_num_threads(saved)
        self._host_position = p + 1
        return out

    def _advance(self, tokens, host_position=None):
        """One step on tensors only, nothing read back (``host_position``: eager steps' int)."""
        logits = self._steps(tokens, self._position, host_position)
        self._position.add_(1)
        return logits
