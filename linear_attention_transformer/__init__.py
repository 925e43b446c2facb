"""linear_attention_transformer: transformers whose attention costs O(n) in sequence length.

Where things live:
    ops/             pure tensor functions: linear attention (non-causal, chunked causal,
                     one recurrent step) and the naive references they must equal
    attention.py     the attention layer: global linear heads beside local softmax heads
    linformer.py     Linformer attention (projected keys/values), for fixed-length inputs
    images.py        linear attention over image pixels
    feedforward.py, positional.py, token_shift.py   the other pieces of a layer
    reversible.py    reversible residual composition (activations recomputed in backward)
    transformer.py   the layer stack;  lm.py  the token model
    context_parallel.py  one sequence split over processes (what the slices exchange)
    autoregressive.py  training loss and sampling (autoregressive_wrapper.py: upstream's
                     import path for the same names)
    compat.py        names the upstream packages use (Linformer, LinformerLM, LinearImageAttention);
                     seed_names.py is its former name, deprecated (importing it warns)
"""

# the one place the version is written: setup.py reads it from here
__version__ = "0.2.0"

from .attention import Attention, LinearSelfAttention
from .autopadder import Autopadder
from .autoregressive import AutoregressiveWrapper
from .compat import LinearImageAttention, Linformer, LinformerLM
from .context_parallel import ContextParallel
from .images import ImageLinearAttention
from .linformer import LinformerContextSettings, LinformerSelfAttention, LinformerSettings
from .lm import LinearAttentionTransformerLM
from .transformer import LinearAttentionTransformer

__all__ = ["Attention", "Autopadder", "AutoregressiveWrapper", "ContextParallel", "ImageLinearAttention",
           "LinearAttentionTransformer", "LinearAttentionTransformerLM", "LinearImageAttention", "LinearSelfAttention",
           "Linformer", "LinformerContextSettings", "LinformerLM", "LinformerSelfAttention", "LinformerSettings"]
