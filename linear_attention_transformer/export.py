"""The one-token decoding step of a ``LinearAttentionTransformerLM`` as an ONNX graph.

``export_onnx(model, path)`` writes one graph that takes ``input_ids`` (batch, 1) int64 and
the decoding state, and gives ``logits`` (batch, num_tokens) and the next state. Every state
input starts at zeros of the shape and dtype the graph declares: the graph reads a position of
zero as the start of a sequence and puts the model's empty state in place of what it is given,
so a runner needs nothing but the graph (examples/onnx_generate.py runs one with onnxruntime
and numpy). A Hugging Face ``LinearAttentionTransformerForCausalLM`` exports as the library
model it holds. What the graph takes and gives, and what is refused: docs/training.md, "Export".

Needs the ``[export]`` extra (onnx, onnxscript, onnxruntime); the package itself does not
import this module.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from .cache import map_tensors, tensors_of
from .lm import LinearAttentionTransformerLM


def state_names(count):
    """The names of the state inputs and of the next-state outputs, in the graph's order."""
    return [f"state_{i}" for i in range(count)], [f"next_state_{i}" for i in range(count)]


def refusal(model):
    """Why ``model``'s decoding step cannot be exported (a sentence), or None."""
    transformer = model.transformer
    if (why := transformer.cache_refusal) is not None:
        return why
    if transformer.attend_axially:
        return "attend_axially=True steps its axial layer on the host, which no graph holds"
    if transformer.receives_context:
        return "receives_context=True reads an encoder's context, which the exported step does not take"
    if model.return_embeddings:
        return "return_embeddings=True gives no logits, and the exported step gives logits"
    return None


class DecodingStep(nn.Module):
    """One token through ``model`` from a flat list of state tensors: ``forward(input_ids,
    *state)`` -> (logits (b, num_tokens), *next_state). A state whose position is zero is read
    as the model's empty state (held here as constants), whatever it holds; the inputs are
    never changed (the model steps copies of them)."""

    def __init__(self, model, batch_size):
        super().__init__()
        self.model = model
        weight = model.token_emb.weight
        self.template = model.empty_cache(batch_size, device=weight.device, dtype=weight.dtype)
        empty = tensors_of(self.template)
        self.position_index = next(i for i, t in enumerate(empty) if t is self.template.position)
        self.state_count = len(empty)
        for i, tensor in enumerate(empty):
            # buffers, so that the graph holds them as constants (not saved in a state dict)
            self.register_buffer(f"empty_{i}", tensor.clone(), persistent=False)

    def empty_state(self):
        """The model's empty state, in the graph's order."""
        return [getattr(self, f"empty_{i}") for i in range(self.state_count)]

    def zero_state(self):
        """What a runner feeds first: zeros of each state tensor's shape and dtype."""
        return [torch.zeros_like(t) for t in self.empty_state()]

    def forward(self, input_ids, *state):
        start = state[self.position_index] == 0
        # (torch.where makes new tensors: the model steps them in place, never the inputs)
        fresh = iter([torch.where(start, empty, given) for empty, given in zip(self.empty_state(), state)])
        cache = map_tensors(self.template, lambda t: next(fresh))
        logits, cache = self.model(input_ids, cache=cache, return_cache=True)
        return (logits[:, -1], *tensors_of(cache))


def _library_model(model):
    """``model`` itself, or the ``LinearAttentionTransformerLM`` that a Hugging Face
    ``LinearAttentionTransformerForCausalLM`` holds (its ``.model``)."""
    # (an instance of the wrapper exists only once linear_attention_transformer.hf is imported:
    # looked up there, so this module never imports transformers itself)
    hf = sys.modules.get(f"{__package__}.hf")
    if hf is not None and isinstance(model, hf.LinearAttentionTransformerForCausalLM):
        return model.model
    return model


def export_onnx(model, path, batch_size=1):
    """Write the one-token decoding step of ``model`` (a ``LinearAttentionTransformerLM``, or
    the Hugging Face ``LinearAttentionTransformerForCausalLM`` of ``linear_attention_transformer.hf``,
    whose ``.model`` is exported) to ``path`` as one ONNX graph, for ``batch_size`` rows
    decoded together.

    Inputs: ``input_ids`` int64 (batch_size, 1), then ``state_0`` ... ``state_{k-1}``.
    Outputs: ``logits`` (batch_size, num_tokens), then ``next_state_0`` ...
    ``next_state_{k-1}``: output ``next_state_i`` is input ``state_i`` at the next step. Every
    state starts at zeros of the shape and dtype the graph declares; one of them is the
    position (int64), which the graph advances by one each step and reads at zero as the start
    of a sequence, so a prompt is read one token at a time from zeros. The graph is the model
    in eval mode (its mode is restored afterwards). A model with rotary or no position
    embedding decodes past ``max_seq_len``; a position table's model up to it (past it the
    runtime fails on the table's index, as the library refuses).

    Raises TypeError unless ``model`` is one of those two and ``path`` a path,
    ValueError for a ``batch_size`` that is not a positive int, and ValueError, saying why, for
    a model whose step the graph cannot hold: no cache (Linformer, not causal),
    ``attend_axially``, ``receives_context``, ``return_embeddings``."""
    model = _library_model(model)
    if not isinstance(model, LinearAttentionTransformerLM):
        raise TypeError(f"model must be a LinearAttentionTransformerLM or a LinearAttentionTransformerForCausalLM, "
                        f"got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    why = refusal(model)
    if why is not None:
        raise ValueError(f"export_onnx cannot export this model's decoding step: {why}")
    training = model.training
    model.eval()
    try:
        step = DecodingStep(model, batch_size).eval()
        state = step.zero_state()
        inputs, outputs = state_names(len(state))
        ids = torch.zeros(batch_size, 1, dtype=torch.long, device=model.token_emb.weight.device)
        with torch.no_grad():
            program = torch.onnx.export(step, (ids, *state), dynamo=True, input_names=["input_ids", *inputs],
                                        output_names=["logits", *outputs], verbose=False)
        program.save(os.fspath(path))  # (weights in the file itself unless past ONNX's 2 GB)
    finally:
        model.train(training)
