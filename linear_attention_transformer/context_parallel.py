"""Context parallelism: one sequence split over the processes of a ``torch.distributed`` group
(how to use it: docs/scale.md). Rank r of P holds the contiguous slice r, of n_local tokens
from position ``r * n_local``. What a layer exchanges is independent of n (LASP-2):

* causal global heads: each rank's ``Summary`` of its slice (``ops/causal/scan.py``), gathered
  by one autograd-aware all-reduce of a (P, …) tensor with each rank's summary in its slot
  (``gather_summaries``); an exclusive ``scan`` over the ranks gives the state before the
  slice, from which the chunked kernel runs. Every rank scans all P summaries, so the gather
  takes part in every rank's backward (rank 0's too, or the others would wait for it);
* non-causal global heads: one autograd-aware all-reduce of kᵀv with its normaliser column
  (the softmax map first all-reduces the keys' per-feature maxima);
* local heads, the convolution and token shift: a few of the neighbours' boundary tokens
  (``exchange_boundaries``), one all-reduce of a (P, F) tensor.

``summary_bytes`` counts what the global heads send. ``torch.distributed.nn.functional``'s
all_reduce is the autograd-aware collective (its deprecation warning is silenced here).
"""

from __future__ import annotations

import warnings

import torch

from .ops import CausalState, causal_linear_attention, linear_attention_readout, linear_attention_summary
from .ops.causal.forms import CHUNK_SIZE
from .ops.causal.scan import Summary, scan, summarize
from .ops.common import append_ones, apply_key_mask, compute_dtype

__all__ = ["ContextParallel", "causal_summary", "gather_summaries", "state_before",
           "context_parallel_causal_linear_attention", "noncausal_summary", "context_parallel_linear_attention",
           "summary_bytes", "exchange_boundaries"]


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("context parallelism needs torch.distributed, which this build of torch lacks")
    return dist


class ContextParallel:
    """Where this process's slice sits in a sequence split over a process group: handed down
    once from the model to every layer that needs it.

    Attributes:
        group: the ``torch.distributed`` process group holding the slices, in rank order.
        rank, world_size: this process's rank in ``group`` and the group's size.
        length: n_local, the length of every slice. start: ``rank * length``, the position
            of this slice's first token in the whole sequence.
    Build it with ``ContextParallel.of(group, batch, length)`` (checks every rank's slice shape).
    """

    __slots__ = ("group", "rank", "world_size", "length", "start")

    def __init__(self, group, rank, world_size, length):
        self.group, self.rank, self.world_size, self.length = group, rank, world_size, length
        self.start = rank * length

    def __repr__(self):
        return (f"ContextParallel(rank={self.rank}, world_size={self.world_size}, length={self.length}, "
                f"start={self.start})")

    @classmethod
    def of(cls, context_parallel, batch: int, length: int, device=None) -> "ContextParallel":
        """``context_parallel`` (a process group, or a ``ContextParallel`` already built for
        this slice) -> ``ContextParallel``. ``batch``, ``length``: this rank's slice (b, n_local).
        TypeError for anything else, ValueError (on every rank alike) when slices differ."""
        if isinstance(context_parallel, ContextParallel):
            if context_parallel.length != length:
                raise ValueError(f"context_parallel describes slices of {context_parallel.length} tokens, "
                                 f"but this input holds {length}")
            return context_parallel
        dist = _dist()
        if not isinstance(context_parallel, dist.ProcessGroup):
            raise TypeError("context_parallel must be a torch.distributed ProcessGroup (or a ContextParallel), "
                            f"got {type(context_parallel).__name__}")
        if not dist.is_initialized():
            raise ValueError("context_parallel: torch.distributed is not initialized (init_process_group)")
        rank, world = dist.get_rank(context_parallel), dist.get_world_size(context_parallel)
        if rank < 0:
            raise ValueError("context_parallel: this process is not a member of the given group")
        if length < 1:
            raise ValueError("context_parallel: every rank needs a slice of at least one token")
        shape = torch.tensor([batch, length], dtype=torch.int64, device=device)
        shapes = [torch.empty_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape, group=context_parallel)
        shapes = [tuple(s.tolist()) for s in shapes]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("context_parallel: every rank must pass a slice of the same (batch, length); got "
                             + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))
        return cls(context_parallel, rank, world, length)


def _autograd_all_reduce(t, group):
    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(t, group=group)


def _gather_by_sum(tensors, rank, world, group):
    """Every rank's ``tensors`` (the same shapes and dtype on each) in rank order, each as a (P,
    …) tensor, with gradients back to the rank that sent it: one autograd-aware all-reduce of
    this rank's tensors, flat in its own row, zeros elsewhere. (Not the autograd all_gather: on
    gloo its backward reads the group ranks as global ranks, wrong in any group but the world's
    first ranks.)"""
    packed = torch.cat([t.flatten() for t in tensors])
    zeros = packed.new_zeros(world - 1, packed.shape[0])
    gathered = _autograd_all_reduce(torch.cat((zeros[:rank], packed[None], zeros[rank:])), group)
    return [g.view(world, *t.shape) for t, g in zip(tensors, gathered.split([t.numel() for t in tensors], dim=1))]


def exchange_boundaries(parts, place: ContextParallel, before: int, after: int):
    """The neighbours' boundary tokens, with gradients back to the ranks they came from.

    Args:
        parts: sequence of (tensor, dim); every tensor holds the slice's n_local tokens
            along ``dim`` (n_local >= before and >= after), the same shapes on every rank;
            a bool tensor (a mask) comes back as bool, with False at the sequence's ends.
        place: the slice's ``ContextParallel``. before, after: how many tokens each side.
    Returns:
        [(halo_before, halo_after)] per part: the previous rank's last ``before`` and the next
        rank's first ``after`` entries along ``dim`` (zeros at the sequence's ends).
    """
    if before < 0 or after < 0:
        raise ValueError("before and after must be >= 0")
    dtype = torch.float32
    for t, _ in parts:
        if t.dtype != torch.bool:
            dtype = torch.promote_types(dtype, t.dtype)
    pieces = []
    for t, dim in parts:
        n = t.shape[dim]
        if n < before or n < after:
            raise ValueError(f"context_parallel: a slice of {n} tokens is shorter than the {max(before, after)} "
                             "boundary tokens its neighbours need; use fewer ranks or longer slices")
        pieces += [t.narrow(dim, 0, after).to(dtype), t.narrow(dim, n - before, before).to(dtype)]
    gathered = _gather_by_sum(pieces, place.rank, place.world_size, place.group)
    rank, world = place.rank, place.world_size
    out = []
    for i, (t, _) in enumerate(parts):
        # every rank reads some row of the result, even at the ends (times 0): the all-reduce
        # then takes part in every rank's backward, or the ranks that read it would wait forever
        tail_prev = gathered[2 * i + 1][(rank - 1) % world] * float(rank > 0)
        head_next = gathered[2 * i][(rank + 1) % world] * float(rank < world - 1)
        if t.dtype == torch.bool:
            tail_prev, head_next = tail_prev.detach() > 0.5, head_next.detach() > 0.5
        else:
            tail_prev, head_next = tail_prev.to(t.dtype), head_next.to(t.dtype)
        out.append((tail_prev, head_next))
    return out


def causal_summary(k, v, log_decay=None, mask=None, exp_features=False) -> Summary:
    """The ``Summary`` of a slice from a zero start, in O(n d e): k (b, h, n, d) features (logits
    with ``exp_features``), v (b, h, n, e), log_decay and mask as ``causal_linear_attention``.
    Returns Summary(kv (b, h, d, e + 1), log_decay (b, h, 1 or d) or None, ref (b, h, d) or
    None), in at least float32."""
    dtype = compute_dtype(k)
    k, v, ld = apply_key_mask(k.to(dtype), v.to(dtype), None if log_decay is None else log_decay.to(dtype), mask,
                               exp_features)
    total = to_end = None
    if ld is not None:
        ld = ld if ld.ndim == 4 else ld[..., None]  # (b, h, n, 1 or d)
        total = ld.sum(dim=2)  # (b, h, 1 or d)
        # the decay from each key to the slice's end, sum_{t > j} log a_t: an exclusive
        # reverse cumulative sum (no cancellation, every entry <= 0)
        later = torch.cat((torch.zeros_like(ld[:, :, :1]), ld.flip(2)[:, :, :-1]), dim=2)
        to_end = later.cumsum(dim=2).flip(2)
    summary, _ = summarize(k, append_ones(v), to_end, total, exp_features)
    return summary


def gather_summaries(summary: Summary, group) -> Summary:
    """Every rank's ``Summary`` (kv (b, h, d, E), log_decay (b, h, g) or None, ref (b, h, d) or
    None; the same shapes on every rank) in rank order: a Summary of (P, b, h, …) tensors, with
    gradients back to the rank that made each (``ref`` without gradient)."""
    dist = _dist()
    kv, g, ref = summary
    parts = [kv] + [t.to(kv.dtype) for t in (g, None if ref is None else ref.detach()) if t is not None]
    gathered = _gather_by_sum(parts, dist.get_rank(group), dist.get_world_size(group), group)
    return Summary(gathered[0], None if g is None else gathered[1], None if ref is None else gathered[-1].detach())


def state_before(summaries: Summary, rank: int, start: int = 0, blindspot_size: int = 1) -> CausalState:
    """The ``CausalState`` before rank ``rank``'s slice (first position ``start``, a multiple of
    ``blindspot_size``): this rank's entry of the exclusive scan of ``gather_summaries``'
    (P, b, h, …) output over all P ranks."""
    if start % blindspot_size:
        raise ValueError(f"context_parallel: a slice must start at a blindspot block boundary (a multiple of "
                         f"blindspot_size={blindspot_size}), got start {start}")
    before, _ = scan(summaries, dim=0, drops=True)
    ref = None if before.ref is None else before.ref[rank]
    kv = before.kv[rank]
    return CausalState.at_block_boundary(kv, ref, start, blindspot_size > 1)


def context_parallel_causal_linear_attention(q, k, v, place: ContextParallel, log_decay=None, mask=None,
                                             chunk_size=CHUNK_SIZE, exp_features=False, blindspot_size=1,
                                             kernel="auto"):
    """``causal_linear_attention`` (with ``kernel``) on this rank's slice (the arguments' n: n_local, a multiple of
    ``blindspot_size``) of a sequence split over ``place.group``: (b, h, n_local, e), equal to
    the whole sequence's output at the slice's positions."""
    if place.length % blindspot_size:
        raise ValueError(f"context_parallel: the slice length ({place.length}) must be a multiple of "
                         f"blindspot_size ({blindspot_size})")
    summaries = gather_summaries(causal_summary(k, v, log_decay, mask, exp_features), place.group)
    state = state_before(summaries, place.rank, place.start, blindspot_size)
    return causal_linear_attention(q, k, v, log_decay, mask, blindspot_size=blindspot_size, chunk_size=chunk_size,
                                   exp_features=exp_features, state=state, kernel=kernel)


def noncausal_summary(k, v, group, mask=None, normalize=True, softmax_keys=False, key_scale=None):
    """``linear_attention_summary`` of the whole sequence's keys from this rank's slice (k, v,
    mask: (b, h, n_local, …)): one autograd-aware all-reduce of the slice's kᵀv.
    ``softmax_keys``: k are logits taking a softmax over the whole sequence (masked keys take
    no part, as in ``FeatureMap.noncausal_keys``); ``key_scale``: a factor on each key's
    features after it, broadcastable to k (a forget gate without a causal order)."""
    dist = _dist()
    dtype = torch.promote_types(k.dtype, torch.float32)
    k, v = k.to(dtype), v.to(dtype)
    keep = None if mask is None else mask[:, None, :, None]
    z = None
    if softmax_keys:
        if keep is not None:
            k = k.masked_fill(~keep, torch.finfo(k.dtype).min)
        with torch.no_grad():
            top = k.detach().amax(dim=2)  # (b, h, d)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a fresh tensor: no caller's
        k = (k - top[:, :, None]).exp()
        z = k.sum(dim=2)  # the slice's part of the softmax's denominator (masked keys included)
    if key_scale is not None:
        k = k * key_scale.to(dtype)
    kv, _ = linear_attention_summary(k, v, mask, normalize)
    if z is None:
        return _autograd_all_reduce(kv, group), normalize
    total = _autograd_all_reduce(torch.cat((kv, z[..., None]), dim=-1), group)
    return total[..., :-1] / total[..., -1:], normalize


def context_parallel_linear_attention(q, k, v, place: ContextParallel, mask=None, normalize=True,
                                      softmax_keys=False, key_scale=None):
    """Non-causal linear attention of this rank's queries q (b, h, n_local, d) over the whole
    sequence's keys (the rest as ``noncausal_summary``): (b, h, n_local, e)."""
    summary = noncausal_summary(k, v, place.group, mask, normalize, softmax_keys, key_scale)
    return linear_attention_readout(q, summary)


def summary_bytes(b, h, d, e, world_size, causal=True, exp_features=False, gate_width=0, normalize=True,
                  softmax_keys=False, dtype=torch.float32):
    """(forward, backward): the bytes one rank hands to the collectives of one layer's global
    heads (see the module docstring). b, h, d, e: batch, global heads, key and value width;
    ``gate_width``: 0 (no decay), 1 (per head) or d (per key feature). Independent of the
    sequence length."""
    size = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    if causal:
        summary = world_size * b * h * (d * (e + 1) + gate_width + (d if exp_features else 0)) * size
        return summary, summary
    summary = b * h * d * (e + int(normalize) + int(softmax_keys)) * size
    return summary + (b * h * d * size if softmax_keys else 0), summary
