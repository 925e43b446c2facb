"""The local heads on PyTorch's ``flex_attention``: the GPU's form of ``windowed_attention``.

``flex_windowed_attention`` computes what ``windowed_attention`` computes (its rule is
``Window.visible``, stated once in ``windowed_attention.py``), through
``torch.nn.attention.flex_attention``: a ``mask_mod`` asks ``Window.visible`` of the two
tokens' positions (segment-relative with ``segments``), and also whether they share a segment
and whether the key is real. ``create_block_mask`` turns it into a block-sparse mask, so a
compiled kernel visits only the key blocks inside some query's window and never stores the
(n, n) scores. A query that sees no key gets 0, as in the blocked form.

Non-finite inputs (``non_finite.py``) are read as 0, as in the blocked form; a query is then
NaN when its own token or a key it sees is non-finite. The keys a query sees lie between
two positions (the window's first and last visible key, clipped to the query's segment and
the sequence), so ``non_finite.seen`` answers that from a running count of the bad keys,
without a second pass over the window.

Which form runs is decided in one place, ``local_form``:

=========  ====================================  ===========  ========================================
requested  where                                 form         why
=========  ====================================  ===========  ========================================
auto       CUDA, flex_attention imports,         blocked,     ``FLEX_ON_CUDA``: flex (a fused kernel over
           float16 / bfloat16 / float32          then flex    the window's blocks only, no (n, w) score
                                                              blocks stored) once a GPU run has checked
                                                              it; none has yet
auto       anywhere else (the CPU above all)     blocked      torch 2.13 has no flex backward on the
                                                              CPU, and its eager flex materialises
                                                              all (n, n) scores
blocked    anywhere                              blocked      ``windowed_attention``
flex       anywhere flex_attention imports       flex         forced (tests run it eagerly on the CPU)
=========  ====================================  ===========  ========================================

On CUDA outside torch.compile the kernel is compiled once here (``torch.compile`` of
``flex_attention``) and the block mask is built compiled; inside a compiled model the call is
traced with the rest. Eagerly on the CPU flex_attention runs unfused (a forward only): that
is how the tests hold it equal to the blocked form. No GPU timing exists yet.
"""

from __future__ import annotations

import functools

import torch

from .non_finite import poisoned, seen
from .segments import positions_in_segment, segment_runs
from .windowed_attention import Window, _quarantine

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    create_block_mask = flex_attention = None

LOCAL_FORMS = ("auto", "blocked", "flex")
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# what 'auto' runs on CUDA: 'blocked' until a GPU run has checked the compiled flex kernel
# (forward, backward, recompiles per length); no GPU has been available yet (2026-11-25)
FLEX_ON_CUDA = "blocked"


def local_form(device, dtype=torch.float32, form="auto") -> str:
    """'flex' or 'blocked': the form of a local head's call (the module docstring's table).
    device, dtype: the inputs'. form: the request, one of ``LOCAL_FORMS``."""
    if form not in LOCAL_FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, LOCAL_FORMS))}, got {form!r}")
    if form == "flex":
        if flex_attention is None:
            raise ValueError("form='flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return "flex"
    if form == "auto" and flex_attention is not None and device.type == "cuda" and dtype in FLEX_DTYPES:
        return FLEX_ON_CUDA
    return "blocked"


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def flex_windowed_attention(q, k, v, window: Window, key_mask=None, segments=None):
    """``windowed_attention`` on flex_attention. Args:
        q, k, v: (b, h, n, d). window: ``Window``. key_mask: optional (b, n) bool, True for
            real keys. segments: optional (b, n) segment ids: each segment attends as if alone.
    Returns:
        (b, h, n, d)
    """
    b, _, n, _ = q.shape
    device = q.device
    index = torch.arange(n, device=device)
    runs = None if segments is None else segment_runs(segments)
    positions = index.expand(b, n) if runs is None else positions_in_segment(runs)  # (b, n)
    real = torch.ones(b, n, dtype=torch.bool, device=device) if key_mask is None else key_mask

    def mask_mod(batch, head, i, j):
        visible = window.visible(positions[batch, i], positions[batch, j]) & real[batch, j]
        return visible if runs is None else visible & (runs[batch, i] == runs[batch, j])

    on_gpu = device.type == "cuda"
    per_row = key_mask is not None or runs is not None  # else one mask serves every row
    blocks = create_block_mask(mask_mod, b if per_row else None, None, n, n, device=device, _compile=on_gpu)
    q, k, v, bad = _quarantine(q, k, v)
    attend = _compiled_flex() if on_gpu and not torch.compiler.is_compiling() else flex_attention
    out = attend(q, k, v, block_mask=blocks, scale=q.shape[-1] ** -0.5)
    if bad is None:
        return out
    bad_query, bad_key = bad
    start = index - positions  # where each query's segment starts
    end = start + n - 1 if runs is None else torch.searchsorted(runs, runs, right=True) - 1
    first = start + window.first_key(positions).clamp(min=0)
    if window.causal:
        last = index.expand(b, n)
    else:  # the end of the window look_forward windows after the query's (Window.visible)
        last = torch.minimum(start + (positions // window.size + window.look_forward + 1) * window.size - 1, end)
    hit = seen(bad_key & real[:, None], last[:, None].clamp(max=n - 1), first[:, None])
    return poisoned(out, bad_query | hit)
