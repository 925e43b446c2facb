"""Fast decoding: a running decoder that takes one token per row per step.

``Decoder`` is the loop of ``AutoregressiveWrapper.generate``: primed once with the prompt
(``LinearAttentionTransformerLM.start_decoding``: the model's cached path), then ``step(tokens)`` feeds one token per row
and returns the next logits. Each stateful module has one ``step`` that writes its part of the
cache in place (``LinearAttentionTransformerLM.step`` -> ``Branch.step`` -> ``Attention.step``):
the decoder's state *is* the cache. The decoder keeps the loop, what the steps read besides the
cache (made once: ``model.prepare_step``, e.g. each attention layer's concatenated projection
weights), the thread count of an eager step, and on CUDA the static addresses of both.

The position is the cache's (``DecodingCache.counter``), kept also as a tensor on the model's
device and advanced in place, and every choice that follows from it is a tensor operation: a
step reads nothing back to the host, allocates nothing that lasts, and
``torch.compile(decoder.step, fullgraph=True)`` traces one graph for every position
(``mode="reduce-overhead"``: a CUDA graph, the cache and the made-once tensors static). Eager
steps also know the position on the host and use it where it saves work. A model with axial
attention (``attend_axially``) steps that layer on its cached path: eager only.
"""

from __future__ import annotations

import torch

from .cache import tensors_of
from .ops.segments import check_integer_ids
from .place import Place

__all__ = ["Decoder"]

# eager steps on a CPU for at most this many rows run on one thread (Decoder.step_threads)
ONE_THREAD_MAX_BATCH = 8


class Decoder:
    """One running sequence per row (see the module docstring), built by the model's
    ``start_decoding`` from the ``DecodingCache`` of its prompt (``batch`` rows; ``input_mask``:
    the prompt's).

    It owns and steps its prompt's ``DecodingCache`` (``decoder.cache``: clone it to keep a
    copy); what the steps read besides it is made when the decoder is built, so parameters
    changed afterwards are not seen. ``step(tokens (b,) integer) -> logits (b, num_tokens)``;
    ``max_seq_len`` is checked on the host eagerly, on the device compiled. ``position``:
    tokens consumed (prompt included; the cache's). ``step_threads``: the torch thread count
    of an eager step (None: torch's own); on a CPU 1 for at most ``ONE_THREAD_MAX_BATCH`` rows:
    a step's small operations gain nothing from a second thread and wait for it when another
    process holds the core (benchmarks/README.md). ``compilable``: whether the step compiles as
    one graph (not with axial attention).
    """

    def __init__(self, model, cache, batch, input_mask=None):
        self.model, self.cache, self.batch, self.max_seq_len = model, cache, batch, model.max_seq_len
        self.device = device = model.token_emb.weight.device
        self.step_threads = 1 if device.type == "cpu" and batch <= ONE_THREAD_MAX_BATCH else None
        self.compilable = not model.transformer.attend_axially
        # the latest first real token over the rows (prompts are padded on the left)
        first_real = 0
        if input_mask is not None:  # (a row without any: its first generated token; built once: a sync is fine)
            first = torch.where(input_mask.any(dim=1), input_mask.int().argmax(dim=1), input_mask.shape[1])
            first_real = int(first.max())
        self.made = model.prepare_step(cache, batch, first_real)
        cache.counter.on(device)
        if device.type == "cuda":  # CUDA graphs: the tensors a step reads keep their addresses
            # (only there: importing torch._dynamo takes seconds, and a CPU has no graphs to capture)
            self.mark_static()

    def buffers(self):
        """Every tensor the steps update in place (their shapes never change): the position
        and the cache's buffers."""
        return tensors_of(self.cache)

    def static_tensors(self):
        """Every tensor a traced step reads or writes other than the model's parameters: the
        cache's buffers and what ``prepare_step`` made (the inputs a CUDA graph keeps)."""
        found = self.buffers()
        for pair in self.made.layers:
            for made in pair:
                found += [] if made is None else made.tensors()
        return found + ([] if self.made.table is None else [self.made.table])

    def mark_static(self):
        """Mark ``static_tensors`` as static addresses (``torch._dynamo.mark_static_address``):
        a CUDA graph of the step then reads them where they are, with no copy per replay."""
        for tensor in self.static_tensors():
            torch._dynamo.mark_static_address(tensor)

    @property
    def position(self):
        return self.cache.position

    def step(self, tokens):
        check_integer_ids(tokens, "tokens")
        if tokens.dtype != torch.int64:  # (any integer dtype: the embedding takes int64)
            tokens = tokens.long()
        if tuple(tokens.shape) != (self.batch,):
            raise ValueError(f"tokens must have shape ({self.batch},): one token per row, got {tuple(tokens.shape)}")
        counter = self.cache.counter
        if torch.compiler.is_compiling():
            # no host count under compile (a Python int that changes would recompile): the
            # device checks, and an eager step after this reads the position back
            torch._assert_async(counter.tensor < self.max_seq_len,
                                "decoder step past max_seq_len: sequence length exceeds max_seq_len")
            with torch.no_grad():
                return self._advance(tokens, None)
        p = int(counter)
        if p >= self.max_seq_len:
            raise ValueError(f"sequence length {p + 1} exceeds max_seq_len={self.max_seq_len}")
        threads, saved = self.step_threads, None
        if threads is not None and torch.get_num_threads() != threads:
            saved = torch.get_num_threads()
            torch.set_num_threads(threads)
        # under autocast a step takes the form a compiled step traces (its F.linear casts; the
        # eager form writes into buffers of the model's dtype)
        host = None if torch.is_autocast_enabled(self.device.type) else p
        try:
            if torch.is_inference_mode_enabled():  # (generate runs in it: no context to enter)
                return self._advance(tokens, host)
            with torch.inference_mode():
                return self._advance(tokens, host)
        finally:
            if saved is not None:
                torch.set_num_threads(saved)

    def _advance(self, tokens, host_position):
        """One step on tensors only, nothing read back (``host_position``: eager steps' int)."""
        counter = self.cache.counter
        rotary = self.model.transformer.rotary
        at = Place(host_position, True, rotary=None if rotary is None else rotary(counter.tensor[None]),
                   tensor=counter.tensor)
        logits = self.model.step(tokens, self.cache, self.made, at)
        counter.advance()
        return logits

