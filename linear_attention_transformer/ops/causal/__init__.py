"""Causal linear attention, laid out by form (as flash-linear-attention lays out ``ops/<op>/``).

The same computation in three views, each the judge of the next:

* ``naive.py``: the explicit (n x n) weight matrix            -> ``naive_causal_linear_attention``
* ``recurrent.py``: the recurrence S_t = a_t S_{t-1} + k_t v_tᵀ -> ``causal_linear_attention_step``,
  ``recurrent_causal_linear_attention``, ``CausalState``
* ``chunk.py``: quadratic inside chunks, a state between them  -> ``causal_linear_attention``

``scan.py`` holds the chunk summaries and the one operator that combines them (also what
context parallelism exchanges); ``forms.py`` picks the form of the chunked kernel.
"""

from .chunk import causal_linear_attention
from .naive import naive_causal_linear_attention
from .recurrent import CausalState, causal_linear_attention_step, recurrent_causal_linear_attention

__all__ = ["CausalState", "causal_linear_attention", "causal_linear_attention_step", "naive_causal_linear_attention",
           "recurrent_causal_linear_attention"]
