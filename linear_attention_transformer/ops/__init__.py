"""Pure tensor functions: no parameters, no modules. Each fast form has its reference beside it."""

from .feature_maps import FEATURE_MAP_NAMES, FeatureMap
from .linear_attention import (
    CausalState,
    causal_linear_attention,
    causal_linear_attention_step,
    linear_attention,
    linear_attention_readout,
    linear_attention_summary,
    naive_causal_linear_attention,
    naive_linear_attention,
    recurrent_causal_linear_attention,
)
