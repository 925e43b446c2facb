"""The delta rule: a causal state that replaces the value stored under a key instead of adding
to it (DeltaNet; with a forget gate, Gated DeltaNet). Per head, with S_t a (d x e) map from
keys to values,

    S_t = a_t (I - b_t k_t k_tᵀ) S_{t-1} + b_t k_t v_tᵀ,    o_t = S_tᵀ q_t,

q and k of norm <= 1 (the layer normalises them), b_t in (0, 1) the writing strength, a_t in
(0, 1] the forget gate (1 without one). Read as an update: the state's prediction for k_t,
u_t = (a_t S_{t-1})ᵀ k_t, moves towards v_t by b_t, S_t = a_t S_{t-1} + b_t k_t (v_t - u_t)ᵀ.

In the same layout as ``ops/causal``:

* ``naive.py``: the recurrence with explicit (d x d) matrices, token by token -> ``naive_delta_rule``
* ``recurrent.py``: one token in place on a decoder's state                  -> ``delta_rule_step``
* ``chunk.py``: the chunked (WY) form for training and prefill                -> ``chunk_delta_rule``
* ``fla.py``: the same on flash-linear-attention's kernels (``chunk_delta_rule``'s ``kernel``)
"""

from .chunk import chunk_delta_rule
from .naive import naive_delta_rule
from .recurrent import delta_rule_step

__all__ = ["chunk_delta_rule", "delta_rule_step", "naive_delta_rule"]
