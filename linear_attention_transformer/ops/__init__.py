"""Pure tensor functions: no parameters, no modules. Each fast form has its reference beside it."""

from .causal import (CausalState, causal_linear_attention, causal_linear_attention_step, naive_causal_linear_attention,
                     recurrent_causal_linear_attention)
from .delta import chunk_delta_rule, delta_rule_step, naive_delta_rule
from .feature_maps import FEATURE_MAP_NAMES, FeatureMap
from .linear_attention import linear_attention, linear_attention_readout, linear_attention_summary, naive_linear_attention
