"""The chunked causal kernel on flash-linear-attention's Triton kernels (``fla-core``, the
optional ``cuda`` extra; ``forms.py`` picks it).

fla's ``chunk_gla`` runs, per head, the gated recurrence

    S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ q_t      (scale 1 here)

with one log gate per key feature; ``chunk_simple_gla`` the same with one gate per head, or
none. Both start from a given state (``initial_state``), return the last one
(``output_final_state``) and run packed sequences (``cu_seqlens``: the state restarts at each
sequence's first token). ``causal_linear_attention`` is that recurrence once its options are
written in fla's terms:

* the normaliser is the all-ones value column (``append_ones``), as in every form here, and
  the output is divided after; the state is then exactly ``CausalState.kv`` (d x e+1);
* given features: q, k as they are; ``log_decay`` is fla's g (per head) or gk (per feature);
* exponential features, exactly: with r_t the decayed running maximum of the key logits,
  r_t = max(r_{t-1} + a_t, k_t) per feature (``scan.references`` taken token by token, from
  the state's ``ref``), the pair (i, j <= i) of feature d is

      exp(q_id + r_id - M_i) * exp(k_jd - r_jd) * prod_{j<s<=i} exp(a_sd + r_{s-1,d} - r_sd)

  whose product telescopes back to exp(q_id + k_jd + a_{j+1..i}) / exp(M_i). The query factor
  is <= 1 with M_i = max_d (q_id + r_id) (M cancels in the ratio; its largest factor is 1), the
  key factor is <= 1, and the third is a per-feature gate a_t + r_{t-1} - r_t <= 0: a GLA
  recurrence. A key that sets r_id is a term of exactly 1 for query i, so the denominator is
  >= 1 and every term the kernels' float32 exponentials drop is < e^-87 of it: exact at any
  logit spread. The references carry no gradient (any r cancels). Where r is -inf (no key
  yet) or a segment starts, the gate acts on an empty state: it is set to 0;
* ``mask``: masked keys and values are zero (logits -inf) and do not decay
  (``apply_key_mask``);
* ``segments``: the batch is flattened into one row and each segment is one of fla's
  sequences (``cu_seqlens``; finding the starts reads them back to the host);
* a state: ``initial_state`` is ``state.kv``, the final state comes back with the last
  reference r (exponential features);
* the blindspot (query i sees key j when j's block of B tokens is before i's): a plain causal
  sequence of each block's queries, then its keys (2n - B tokens, the last block's keys left
  out): query tokens carry the decay, key tokens are taken decayed to their block's end and
  carry none, so key j reaches query i decayed by exactly a_{j+1..i}. With segments a query
  whose segment starts in its own block sees nothing (no query factor), and each segment's
  first key starts one of fla's sequences. The returned state is the one after the last
  query token, with the last block's keys pending (``scan.summarize``), joined when that
  block is complete (``scan.combine``).

Under torch.compile the kernels run between graphs: fla's entry points are
``torch.compiler.disable``d, so a compiled model breaks its graph at each call (with
``fullgraph=True``, name ``kernel='torch'``). Not mapped: float64 (the kernels are float32).
Where fla cannot serve 'auto' on CUDA (not installed, does not import, ``known_bad_pair``),
the torch kernel runs and says why once (``warn_unavailable``). Non-finite
inputs are quarantined by the caller as for every kernel (``non_finite.py``): read as 0 here,
then the queries that see one are NaN.

fla is imported only when this form is asked for; the package imports and runs without it.
The kernels compute in the inputs' compute dtype (float32 for half inputs, as every form
here: the normaliser sums up to n terms).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import warnings

import torch
import torch.nn.functional as F
from einops import rearrange

from ..common import (NEG_INF, append_ones, apply_key_mask, divide_by_normaliser, exp_ratio, log_ratio,
                      queries_relative_to)
from ..segments import segment_runs
from .recurrent import CausalState
from .scan import Summary, combine, references, summarize

__all__ = ["fla_causal_linear_attention", "fla_missing", "fla_unavailable", "import_failure", "known_bad_pair",
           "warn_unavailable"]

KERNEL_DTYPES = (torch.float32,)  # the compute dtypes fla's kernels are built and tested for


def _kernels():
    """(chunk_simple_gla, chunk_gla) from fla: the one place this form reaches fla (the
    tests put a float64 recurrence with their contract here)."""
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla, chunk_gla


FIX = "pip install -e '.[cuda]' in a clone of this library, or pip install 'fla-core>=0.5.1,<0.7'"


def import_failure(load):
    """Why ``load`` (a function that imports fla's kernels) fails (a phrase naming the fix), or None."""
    try:
        load()
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] == "fla":
            return f"fla-core is not installed; {FIX}"
        return f"fla-core does not import ({type(error).__name__}: {error}); {FIX}"
    except Exception as error:  # (an fla that does not match its Triton fails on import, not always ImportError)
        return (f"fla-core does not import ({type(error).__name__}: {error}); {FIX}, an fla-core that supports "
                "this Triton (docs/kernels.md lists the tested ones)")
    return None


@functools.lru_cache(maxsize=None)
def _import_error():
    """Why this form's kernels do not import (a phrase), or None; tried once per process."""
    return import_failure(_kernels)


def _interpreted():
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET=1 set before
    triton is imported)."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)  # (Triton < 3.4 reads the variable itself)
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"


def _release(text):
    """(major, minor, patch) of a version string, ignoring local and pre-release parts."""
    numbers = [int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def known_bad_pair(triton_version, capability_major, has_tilelang):
    """Why fla's gated chunk backward (``chunk_bwd_dqkwg`` with a gate) cannot run here (a
    phrase), or None.

    Every fla-core line (0.5, 0.6) refuses it on Hopper (compute capability 9) with Triton
    3.4.0 to 3.7.0, where Triton computed it wrongly, unless tilelang is installed (fla then
    computes it with tilelang). The affected calls, needing gradients (``fla_missing``'s
    ``gated_backward``): ``chunk_simple_gla`` with a per-head decay (given features here), and
    every ``chunk_gated_delta_rule`` (``ops/delta/fla.py``)."""
    if capability_major == 9 and (3, 4, 0) <= _release(triton_version) < (3, 7, 1) and not has_tilelang:
        return (f"fla-core refuses the gated backward of chunk_simple_gla and chunk_gated_delta_rule on Hopper with "
                f"Triton {triton_version} (3.4.0 to 3.7.0 computed it wrongly); pip install tilelang, or a "
                "Triton >= 3.7.1")
    return None


@functools.lru_cache(maxsize=None)
def _environment(device_index):
    """(Triton's version, the CUDA device's compute capability major, tilelang importable)."""
    import triton

    capability = torch.cuda.get_device_capability(device_index)[0]
    return triton.__version__, capability, importlib.util.find_spec("tilelang") is not None


@torch.compiler.assume_constant_result  # (an answer about the process: read once, constant in a trace)
def fla_unavailable(device_type: str, device_index: int, gated_backward: bool):
    """Why fla cannot serve a call on this machine (not installed, does not import, a known-bad
    pair for the call), or None. ``device_index``: the CUDA device's (-1 elsewhere)."""
    why = _import_error()
    if why is None and gated_backward and device_type == "cuda":
        why = known_bad_pair(*_environment(device_index))
    return why


_WARNED = set()


def warn_unavailable(reason):
    """One RuntimeWarning per process and reason: 'auto' runs the torch kernel where it would
    have run fla's kernels."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"kernel 'auto' runs the torch kernel on CUDA instead of fla's kernels: {reason} "
                      "(kernel='torch' chooses it without this warning)", RuntimeWarning, stacklevel=4)


def fla_missing(device, dtype=torch.float32, gated_backward=False, unavailable=None):
    """Why the fla kernel cannot run such a call on ``device`` in compute dtype ``dtype`` (a
    phrase), or None when it can. ``gated_backward``: given features with a per-head decay,
    needing gradients (``known_bad_pair``). ``unavailable``: another op's ``fla_unavailable``
    (the delta rule's, whose kernels import on their own), else this module's. Imports fla
    only once the cheaper reasons are ruled out."""
    if dtype not in KERNEL_DTYPES:
        return f"fla's kernels compute in float32 (half inputs included), not in {dtype}"
    if device.type == "cpu" and not _interpreted():
        return ("on the CPU fla's Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before "
                "triton's import)")
    if device.type not in ("cpu", "cuda"):
        return f"fla's Triton kernels run on CUDA, not on {device.type}"
    index = -1 if device.type != "cuda" else device.index if device.index is not None else \
        torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (unavailable or fla_unavailable)(device.type, index, gated_backward)


def _exp_feature_factors(q, k, log_decay, start, starts):
    """Exponential features as a GLA recurrence (module docstring): (query factors, key
    factors, per-feature log gate (b, h, n, d), last reference (b, h, d)).

    k: logits, -inf for masked keys; log_decay: None or (b, h, n[, d]) (0 where masked);
    start: the state's reference or None; starts: None or (b, n), a segment's first token."""
    decay = None if log_decay is None else log_decay if log_decay.ndim == 4 else log_decay[..., None]
    if starts is not None:  # a segment's first token drops what came before it
        decay = torch.zeros_like(k[..., :1]) if decay is None else decay
        decay = decay.masked_fill(rearrange(starts, "b n -> b 1 n 1"), NEG_INF)
    r_prev, r = references(k, decay, start, dim=2, drops=starts is not None)
    gate = log_ratio(r_prev if decay is None else r_prev + decay, r)
    gate = torch.where(torch.isfinite(gate), gate, 0.0)  # an empty state (no key yet, a new segment)
    return queries_relative_to(q, r), exp_ratio(k, r), gate, r[:, :, -1]


def _blindspot_sequence(q, k, v, log_decay, B, exp_features, runs):
    """The blindspot as a plain causal sequence: each block's queries, then its keys (module
    docstring). q, k, v, log_decay as ``_gla`` takes them, for n tokens; runs: None or the
    (b, n) run index. Returns (q, k, v, log_decay, starts) of the (2c - 1) B tokens (c blocks;
    the last block's keys, read by no query here, are left out), and the last block's
    ``Summary`` of keys (its pending keys)."""
    b, h, n, d = q.shape
    c = -(-n // B)
    pad = c * B - n

    def blocks(t, value=0.0):  # (b, h, n, ...) -> (b, h, c, B, ...), padded with invisible tokens
        return F.pad(t, (0, 0, 0, pad) if t.ndim == 4 else (0, pad), value=value).unflatten(2, (c, B))

    no_key = NEG_INF if exp_features else 0.0
    q, k, v = blocks(q), blocks(k, no_key), blocks(v)
    if log_decay is not None:  # each key decayed to its block's end: the key tokens then need no gate
        log_decay = blocks(log_decay)
        G = log_decay.cumsum(dim=3)
        to_end = G[:, :, :, -1:] - G
        to_end = to_end if to_end.ndim == 5 else to_end[..., None]
        k = k + to_end if exp_features else k * to_end.exp()
    pending = summarize(k[:, :, -1], v[:, :, -1], exp_features=exp_features)[0]
    starts = None
    if runs is not None:
        # a query whose segment starts in its own block sees nothing (no query factor); a
        # segment's first key starts one of fla's sequences (as does each row)
        runs = blocks(runs[:, None], -1)[:, 0]  # (b, c, B); padding joins no segment
        before = F.pad(runs[:, :-1, -1], (1, 0), value=-2)  # the run of the token before each block
        q = q.masked_fill(~(runs == before[..., None])[:, None, ..., None], no_key)
        first = runs != torch.cat((before[..., None], runs[:, :, :-1]), dim=2)
        first[:, 0, 0] = False  # (the row's first token: its block's queries start the sequence)
        starts = torch.stack((torch.zeros_like(first), first), dim=2)
        starts[:, 0, 0, 0] = True
    query_tokens = (q, torch.full_like(k, no_key), torch.zeros_like(v))
    key_tokens = (torch.zeros_like(q), k, v)
    interleaved = [torch.stack(pair, dim=3) for pair in zip(query_tokens, key_tokens)]  # (b, h, c, 2, B, ...)
    if log_decay is not None:
        interleaved.append(torch.stack((log_decay, torch.zeros_like(log_decay)), dim=3))
    length = (2 * c - 1) * B
    q, k, v, *decay = (t.flatten(2, 4)[:, :, :length] for t in interleaved)
    starts = None if starts is None else starts.flatten(1, 3)[:, :length]
    return q, k, v, (decay[0] if decay else None), starts, pending


def to_fla(tensors, starts):
    """(b, h, n, ·) tensors -> fla's layout (batch, time, heads, ·), contiguous, and cu_seqlens.
    ``starts``: None, or (b, n) bool, True at each of fla's sequences' first token (then True
    at every row's first): the batch becomes one row of sequences, cu_seqlens their bounds."""
    pattern = "b h n d -> b n h d" if starts is None else "b h n d -> 1 (b n) h d"
    cu_seqlens = None if starts is None else F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=starts.numel())
    return [rearrange(t, pattern).contiguous() for t in tensors], cu_seqlens


def from_fla(out, starts, b):
    """fla's output (``to_fla``'s layout) -> (b, h, n, e)."""
    return rearrange(out, "b n h e -> b h n e" if starts is None else "1 (b n) h e -> b h n e", b=b)


def _gla(q, k, v, log_decay, starts, exp_features, state, return_state):
    """The recurrence on fla's kernels: (out with the normaliser column (b, h, n, e + 1), last
    kv or None, last reference or None). k, v, log_decay: masked (``apply_key_mask``), v with
    the ones column; starts: None or (b, n) bool, True at each of fla's sequence starts (then
    True at every row's first token)."""
    chunk_simple_gla, chunk_gla = _kernels()
    ref = None
    if exp_features:
        q, k, log_decay, ref = _exp_feature_factors(q, k, log_decay, None if state is None else state.ref.to(q.dtype),
                                                    starts)
    b = q.shape[0]
    per_feature = log_decay is not None and log_decay.ndim == 4
    g = None if log_decay is None else log_decay if per_feature else log_decay[..., None]
    (q, k, v, *g), cu_seqlens = to_fla([q, k, v] + ([] if g is None else [g]), starts)
    g = g[0] if per_feature else g[0][..., 0] if g else None
    options = dict(scale=1.0, initial_state=None if state is None else state.kv.to(q.dtype).contiguous(),
                   output_final_state=return_state, cu_seqlens=cu_seqlens)
    out, last = (chunk_gla if per_feature else chunk_simple_gla)(q, k, v, g=g, **options)
    return from_fla(out, starts, b), last, ref


def fla_causal_linear_attention(q, k, v, log_decay=None, mask=None, blindspot_size=1, exp_features=False, state=None,
                                return_state=False, segments=None):
    """``causal_linear_attention`` on fla's chunk kernels: its arguments, checked there, q, k,
    v already in the compute dtype; with a blindspot, a state only at a block boundary (as
    ``causal_linear_attention`` hands it on). Returns (b, h, n, e), and the ``CausalState``
    after the last token when ``return_state``."""
    n = q.shape[2]
    k, v, log_decay = apply_key_mask(k, v, log_decay, mask, exp_features)
    v = append_ones(v)
    runs = None if segments is None else segment_runs(segments)
    position = (0 if state is None else state.position) + n
    if blindspot_size == 1:
        starts = None if runs is None else F.pad(runs[:, 1:] != runs[:, :-1], (1, 0), value=True)
        out, last, ref = _gla(q, k, v, log_decay, starts, exp_features, state, return_state)
        out = divide_by_normaliser(out)
        return (out, CausalState(last, ref, position=position)) if return_state else out

    B = blindspot_size
    *tokens, starts, pending = _blindspot_sequence(q, k, v, log_decay, B, exp_features, runs)
    out, last, ref = _gla(*tokens, starts, exp_features, state, return_state)
    out = divide_by_normaliser(out.unflatten(2, (-1, B))[:, :, ::2].flatten(2, 3)[:, :, :n])  # the query tokens
    if not return_state:
        return out
    if n % B:  # the last block is unfinished: its keys wait in `pending`
        return out, CausalState(last, ref, pending.kv, pending.ref, position)
    last, _, ref = combine(Summary(last, None, ref), pending)  # every block complete: the last one joins
    return out, CausalState.at_block_boundary(last, ref, position, blindspot=True)
