"""The local heads on PyTorch's ``flex_attention``: the GPU's form of ``windowed_attention``.

``flex_windowed_attention`` computes what ``windowed_attention`` computes (its rule is
``Window.visible``, stated once in ``windowed_attention.py``), through
``torch.nn.attention.flex_attention``: a ``mask_mod`` asks ``Window.visible`` of the two
tokens' positions (segment-relative with ``segments``), and also whether they share a segment
and whether the key is real. A block-sparse mask (below) makes a compiled kernel visit only
the key blocks inside some query's window, and it never stores the (n, n) scores. A query
that sees no key gets 0, as in ``windowed_attention``.

Non-finite inputs (``non_finite.py``) are read as 0, as in ``windowed_attention``; a query is then
NaN when its own token or a key it sees is non-finite. The keys a query sees lie between
two positions (the window's first and last visible key, clipped to the query's segment and
the sequence), so ``non_finite.seen`` answers that from a running count of the bad keys,
without a second pass over the window.

Whether a local head's call runs here ('flex') or in ``windowed_attention`` ('windowed') is
``local_implementation``'s answer, the local heads' column of docs/kernels.md's table: on
CUDA for float16 / bfloat16 / float32 heads of at least ``FLEX_MIN_HEAD_DIM`` features (the
Triton kernel's smallest dot) unless the layer's kernel is 'torch'; on the CPU never (torch
has no flex backward there), except where a test calls ``flex_windowed_attention`` itself.

The block mask is built from the window alone (``window_blocks``): for each block of
queries the keys it may see lie between two positions that only grow with the query, so the
key blocks to visit, and those wholly visible ("full": no ``mask_mod`` there), come from
O((n / 128)²) comparisons of block ends, never from evaluating ``mask_mod`` over the (n, n)
grid as ``create_block_mask`` does. It is kept per (n, window, device) and shared by every
call and layer with that window. A key mask or segments are applied by ``mask_mod`` in every
visited block (then no block is full); segments widen the window by one window each side,
as in ``windowed_attention``, since their windows start at each segment's first token.

On CUDA outside torch.compile the kernel is compiled here, once per static configuration
(window, key mask or not, segments or not, dtype, grad mode): each has its own compiled
function, and so its own recompile budget (a second length recompiles it once, to dynamic
shapes), so that many layers, windows and modes never push one function past dynamo's limit,
where it would fall back to the eager flex and its (b, h, n, n) scores. Inside a compiled
model the call is traced with the rest. The tests run it eagerly on the CPU (unfused,
forward only), equal to ``windowed_attention`` in float64. The CPU's compiled flex is not used:
torch's CPU template returned wrong values and NaN on some calls (docs/kernels.md) where the
compiled block mask was right. No GPU has run this implementation yet: the CUDA kernel, its
backward and its timing are unmeasured; ``kernel='torch'`` on a layer keeps ``windowed_attention``.
"""

from __future__ import annotations

import functools
import types

import torch

from .kernels import check_kernel
from .non_finite import poisoned, seen
from .segments import positions_in_segment, segment_runs
from .windowed_attention import Window, quarantine_inputs

from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLEX_MIN_HEAD_DIM = 16  # the Triton kernel's smallest dot: smaller heads keep windowed_attention
BLOCK = 128  # flex_attention's block of queries and of keys
BACKEND = "inductor"  # torch.compile's backend for the kernel (the tests count traces with their own)


def local_implementation(device, dtype=torch.float32, kernel="auto", head_dim=FLEX_MIN_HEAD_DIM) -> str:
    """What runs a local head's call for a layer's ``kernel`` (the local heads' column of
    docs/kernels.md's table): 'flex' (``flex_windowed_attention``) or 'windowed'
    (``windowed_attention``). device, dtype, head_dim: the inputs'."""
    fits = device.type == "cuda" and dtype in FLEX_DTYPES and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if check_kernel(kernel) != "torch" and fits else "windowed"


def _key_bounds(window: Window, n, widen):
    """(first, last): functions of query positions (a tensor) giving the first and last key
    position each may see, clipped to the sequence; both never decrease along the queries.
    ``widen``: segment-relative windows, one window wider each side (a superset)."""
    w, L, F = window.size, window.look_backward, window.look_forward

    def first(i):
        start = i - (w - 1) - L * w if widen and not window.exact else window.first_key(i)
        return start.clamp(min=0)

    def last(i):
        if window.causal:
            return i
        end = i + (F + 1) * w - 1 if widen else (i // w + F + 1) * w - 1
        return end.clamp(max=n - 1)

    return first, last


def window_blocks(n, window: Window, device, widen=False, full=True):
    """The block-sparse structure of ``window`` over n tokens, as ``BlockMask.from_kv_blocks``
    takes it: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), each (1, 1, c
    [, c]) for c blocks of ``BLOCK`` (full ones None without ``full``: every visited block is
    then masked). Each block of queries [r0, r1] visits the key blocks [c0, c1] that meet
    [first(r0), last(r1)], and those inside [first(r1), last(r0)] are full (two blocks of
    ``BLOCK`` tokens)."""
    c = -(-n // BLOCK)
    start = torch.arange(c, device=device) * BLOCK
    end = (start + BLOCK - 1).clamp(max=n - 1)
    first, last = _key_bounds(window, n, widen)
    qs, qe, ks, ke = start[:, None], end[:, None], start[None, :], end[None, :]
    seen = (first(qs) <= ke) & (last(qe) >= ks)
    complete = (end - start + 1) == BLOCK  # (a block the sequence ends inside is never full: create_block_mask's rule)
    whole = (first(qe) <= ks) & (last(qs) >= ke) & complete[:, None] & complete[None, :] if full else \
        torch.zeros_like(seen)
    parts = []
    for kind in (seen & ~whole, whole):
        order = torch.argsort((~kind).to(torch.int8), dim=-1, stable=True)  # this kind's blocks first, in order
        parts += [kind.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]]
    return tuple(parts) if full else (*parts[:2], None, None)


@functools.lru_cache(maxsize=64)
def _cached_blocks(n, window, device, widen, full):
    """``window_blocks``, kept: one structure per (n, window, device) serves every call and layer."""
    return window_blocks(n, window, device, widen, full)


def _mask_mod(window, key_mask, runs, positions):
    def mask_mod(batch, head, i, j):  # (reads only the tensors it needs: i, j are positions unpacked)
        if runs is None:
            visible = window.visible(i, j)
        else:
            visible = window.visible(positions[batch, i], positions[batch, j]) & (runs[batch, i] == runs[batch, j])
        return visible if key_mask is None else visible & key_mask[batch, j]
    return mask_mod


def _flex(q, k, v, blocks, window, key_mask, runs, positions):
    """flex_attention over ``blocks`` (``window_blocks``), masked by the window, the key mask and
    the segments: the function compiled per configuration (``_compiled_flex``)."""
    n = q.shape[2]
    mask_mod = _mask_mod(window, key_mask, runs, positions)
    block_mask = BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(n, n))
    return flex_attention(q, k, v, block_mask=block_mask, scale=q.shape[-1] ** -0.5)


@functools.lru_cache(maxsize=None)
def _compiled_flex(configuration):
    """``_flex`` compiled for one static configuration: a copy of its code object of its own,
    since dynamo keeps its traces, and counts recompiles, per code object."""
    code = _flex.__code__.replace(co_name=f"_flex_{abs(hash(configuration)):x}")
    fresh = types.FunctionType(code, _flex.__globals__, code.co_name, _flex.__defaults__, _flex.__closure__)
    return torch.compile(fresh, backend=BACKEND)


def _compile_here(device):
    """Whether this call compiles its kernel here (CUDA, outside a compiled model)."""
    return device.type == "cuda" and not torch.compiler.is_compiling()


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
    structure = (n, window, device, runs is not None, key_mask is None and runs is None)
    blocks = window_blocks(*structure) if torch.compiler.is_compiling() else _cached_blocks(*structure)
    q, k, v, bad = quarantine_inputs(q, k, v)
    attend = _flex
    if _compile_here(device):
        attend = _compiled_flex((window, key_mask is None, runs is None, q.dtype, torch.is_grad_enabled(),
                                 torch.is_autocast_enabled(device.type)))
    out = attend(q, k, v, blocks, window, key_mask, runs, positions if runs is not None else None)
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
