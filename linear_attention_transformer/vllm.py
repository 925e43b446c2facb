"""Serving with vLLM: a folder written by ``LinearAttentionTransformerForCausalLM.save_pretrained``
runs in vLLM's engine (``LLM(model=folder)``) and its OpenAI-compatible server (``vllm serve
folder``), with no flag beyond vLLM's own.

vLLM finds this module through the ``vllm.general_plugins`` entry point that the package
installs; ``register`` makes the config's ``model_type`` known to transformers and the
``architectures`` name known to vLLM. The whole decoding state of a sequence is fixed in size
(``slots.py``), so all of it goes to vLLM as mamba-type state, held by one state layer: the
global heads' running states, the local heads' rings of recent keys and values, the
convolutions' and the token shifts' last inputs. vLLM assigns each request a slot and tells,
at each call, which tokens belong to which request and how many it has read;
``slots.continue_in_slots`` then runs them through the model's own forward. The local heads
keep their exact windows: they read their own ring, not vLLM's paged attention.

Needs the ``[vllm]`` extra; the package itself does not import this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoConfig
from vllm import ModelRegistry
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .hf import MODEL_TYPE, LinearAttentionTransformerConfig, LinearAttentionTransformerForCausalLM
from .lm import LinearAttentionTransformerLM
from .slots import continue_in_slots, slot_layout

# the name save_pretrained writes into config.json's "architectures"
ARCHITECTURE = LinearAttentionTransformerForCausalLM.__name__


def register():
    """The plugin's entry point, run by vLLM in each of its processes."""
    AutoConfig.register(MODEL_TYPE, LinearAttentionTransformerConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:LinearAttentionTransformerForVLLM")
    # (vLLM's own attention-free models get their state's block size set by this hook)
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, MambaModelConfig)


class SequenceState(nn.Module, MambaBase):
    """A sequence's whole decoding state, as vLLM keeps it: every tensor of ``slot_layout``, for
    all blocks. One state layer, so that vLLM gives a request one slot number (it numbers the
    slots of layers of different layouts apart). ``kv_cache`` (bound by vLLM) holds one view
    (num_slots, *shape) per declared tensor; vLLM packs a slot's tensors one after another in
    one page, so they are declared widest dtype first (each view's offset a multiple of its
    dtype's size), with one padding tensor where the page would end off that multiple. The
    computation is the model's; this layer only declares and holds the state."""

    def __init__(self, layout, prefix):
        super().__init__()
        flat = [entry for block in layout for entry in block]
        self.blocks = [len(block) for block in layout]
        # (sorted stably: each view starts at a multiple of its own dtype's size)
        self.order = sorted(range(len(flat)), key=lambda i: -flat[i][1].itemsize)
        self.declared = [flat[i] for i in self.order]
        widest = self.declared[0][1].itemsize
        size = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.declared)
        if size % widest:
            self.declared.append(((widest - size % widest,), torch.uint8))
        self.prefix = prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate vLLM layer name {prefix!r}")
        context[prefix] = self

    @property
    def mamba_type(self):
        # the linear-attention metadata: per request its tokens, its slot and its length
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return tuple(shape for shape, _ in self.declared)

    def get_state_dtype(self):
        return tuple(dtype for _, dtype in self.declared)

    def pool(self):
        """vLLM's buffers as ``continue_in_slots`` takes them: per block, its tensors in order."""
        views = list(self.kv_cache)
        flat = [None] * len(self.order)
        for view, i in zip(views, self.order):
            flat[i] = view
        at, blocks = 0, []
        for count in self.blocks:
            blocks.append(flat[at : at + count])
            at += count
        return blocks


class LinearAttentionTransformerForVLLM(nn.Module, HasInnerState, IsAttentionFree):
    """A ``LinearAttentionTransformerLM`` (``.model``, the names of the saved weights) run by
    vLLM: ``forward`` continues each request of the batch from its slots, ``compute_logits``
    applies the output layer to the tokens vLLM samples from."""

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LinearAttentionTransformerLM(**config.model_options(), _keywords_checked=True).eval()
        limit, longest = self.model.length_limit, vllm_config.model_config.max_model_len
        if limit is not None and longest > limit:
            raise ValueError(f"max_model_len={longest} exceeds the model's max_seq_len={limit}, "
                             f"{self.model.transformer.limited_by}")
        # (vLLM reads a layer's index from its name: exactly one number in it)
        self.state = SequenceState(slot_layout(self.model), f"{prefix}.layers.0.state" if prefix else "layers.0.state")

    def embed_input_ids(self, input_ids):
        return self.model.token_emb(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: this model reads token ids")
        metadata = get_forward_context().attn_metadata
        features = torch.zeros(input_ids.shape[0], self.config.dim, device=input_ids.device,
                               dtype=self.model.token_emb.weight.dtype)
        if not isinstance(metadata, dict) or self.state.prefix not in metadata:
            return features  # (a warm-up run, with no requests)
        meta = metadata[self.state.prefix]
        requests = meta.num_decodes + meta.num_prefills
        query_starts = meta.query_start_loc[: requests + 1]
        # each request's first new token's position: its length so far, less its new tokens
        starts = meta.seq_lens[:requests] - (query_starts[1:] - query_starts[:-1])
        used = int(query_starts[-1])
        features[:used] = continue_in_slots(self.model, self.state.pool(), input_ids[:used], query_starts,
                                            meta.state_indices_tensor[:requests], starts)
        return features

    def compute_logits(self, hidden_states):
        return self.model.logits_of(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the saved tensors (``model.…`` names, as ``save_pretrained`` writes them) in;
        returns the names loaded. A tied output layer, saved once, is loaded once."""
        own = dict(self.named_parameters())
        own.update(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            if name not in own:
                raise ValueError(f"the checkpoint holds {name!r}, which this model does not have")
            with torch.no_grad():
                own[name].copy_(tensor)
            loaded.add(name)
        return loaded
