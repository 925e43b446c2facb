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

=========  ====================================  =======  ==========================================
requested  where                                 form     why
=========  ====================================  =======  ==========================================
auto       CUDA, flex_attention imports,         flex     a fused kernel over the window's blocks
           float16 / bfloat16 / float32,                  only: no (n, w) score blocks stored, no
           head dim >= 16                                 launch per block
auto       anywhere else (the CPU above all)     blocked  torch 2.13 has no flex backward on the
                                                          CPU; below 16 the head is under the
                                                          Triton kernel's smallest dot
blocked    anywhere                              blocked  ``windowed_attention`` (a layer's
                                                          ``kernel='torch'``)
flex       anywhere flex_attention imports       flex     forced (the tests, on the CPU)
=========  ====================================  =======  ==========================================

On CUDA outside torch.compile the block mask and the kernel are compiled here, once per
process (``torch.compile`` of ``create_block_mask`` and of ``flex_attention``; a second length
recompiles once, to dynamic shapes); inside a compiled model the call is traced with the rest.
The tests run it eagerly on the CPU (unfused, forward only), equal to the blocked form in
float64. The CPU's compiled flex is not used: torch 2.13's CPU template returned wrong values
and NaN on some calls (errors up to 3.5 at n = 40, window 8, an unmasked causal case,
2026-11-25) where the compiled block mask was right. No GPU has run this form yet: the CUDA
kernel, its backward and its timing are unmeasured; ``kernel='torch'`` on a layer keeps the
blocked form.
"""

from __future__ import annotations

import functools

import torch

from .non_finite import poisoned, seen
from .segments import positions_in_segment, segment_runs
from .windowed_attention import Window, quarantine_inputs

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    create_block_mask = flex_attention = None

LOCAL_FORMS = ("auto", "blocked", "flex")
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


FLEX_MIN_HEAD_DIM = 16  # the Triton kernel's smallest dot: smaller heads keep the blocked form


def local_form(device, dtype=torch.float32, form="auto", head_dim=FLEX_MIN_HEAD_DIM) -> str:
    """'flex' or 'blocked': the form of a local head's call (the module docstring's table).
    device, dtype, head_dim: the inputs'. form: the request, one of ``LOCAL_FORMS``."""
    if form not in LOCAL_FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, LOCAL_FORMS))}, got {form!r}")
    if form == "flex":
        if flex_attention is None:
            raise ValueError("form='flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return "flex"
    on_cuda = device.type == "cuda" and dtype in FLEX_DTYPES and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if form == "auto" and flex_attention is not None and on_cuda else "blocked"


@functools.cache
def _compiled(fn):
    """``fn`` compiled once per process (flex_attention and create_block_mask)."""
    return torch.compile(fn)


def flex_windowed_attention(q, k, v, window: Window, key_mask=None, segments=None):
    """``windowed_attention`` on flex_attention. Args:
        q, k, v: (b, h, n, d). window: ``Window``. key_mask: optional (b, n) bool, True for
            real keys. segments: optional (b, n) segment ids: each segment attends as if alone.
    Returns:
        (b, h, n, d)
    """
    b, _, n, _ = q.shape
    device = q.device
    compiled = device.type == "cuda" and not torch.compiler.is_compiling()
    index = torch.arange(n, device=device)
    runs = None if segments is None else segment_runs(segments)
    positions = index.expand(b, n) if runs is None else positions_in_segment(runs)  # (b, n)

    def mask_mod(batch, head, i, j):  # (reads only the tensors it needs: i, j are positions unpacked)
        if runs is None:
            visible = window.visible(i, j)
        else:
            visible = window.visible(positions[batch, i], positions[batch, j]) & (runs[batch, i] == runs[batch, j])
        return visible if key_mask is None else visible & key_mask[batch, j]

    per_row = key_mask is not None or runs is not None  # else one mask serves every row
    block_mask, attend = (_compiled(create_block_mask), _compiled(flex_attention)) if compiled else \
        (create_block_mask, flex_attention)
    blocks = block_mask(mask_mod, b if per_row else None, None, n, n, device=device)
    q, k, v, bad = quarantine_inputs(q, k, v)
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
    bad_key = bad_key if key_mask is None else bad_key & key_mask[:, None]
    hit = seen(bad_key, last[:, None].clamp(max=n - 1), first[:, None])
    return poisoned(out, bad_query | hit)
