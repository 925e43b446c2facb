"""Context parallelism: one sequence split over the processes of a ``torch.distributed`` group.

Rank r of a group of P holds the contiguous slice r of the sequence (in rank order, slices
of equal length n_local, so its first token sits at position ``start = r * n_local``). Each
rank gets back its slice of the output and, after backward, the gradients of the whole
sequence: parameter gradients summed over the ranks equal the one-process gradients.

What a layer's global heads exchange, independent of n (LASP-2):

* causal heads: each rank summarises its slice, ``Summary(kv, log_decay, ref)`` of
  ``ops/causal/scan.py`` (the state the slice adds from a zero start, its total log decay, and for
  exponential features the per-feature reference of kv), in O(n d e) without running the
  kernel; one autograd-aware all-gather of the packed summaries (done as an all-reduce of
  a (P, …) tensor holding each rank's summary in its slot, see ``gather_summaries``); an
  exclusive scan over the ranks gives the state before the rank's slice, from which the
  chunked kernel runs (``causal_linear_attention(..., state=...)``). The gather's backward sends each summary's
  gradient back to the rank that made it, so a key's gradient counts every later rank's
  queries. Every rank computes the exclusive scan over all P summaries and keeps its own
  entry: the gather then takes part in every rank's backward (rank 0 reads nothing from it,
  yet its backward must join the collective, or the others would wait for it forever).
* non-causal heads: one autograd-aware all-reduce of kᵀv with its normaliser column;
  with the softmax feature map (a softmax of the keys over the whole sequence) first an
  all-reduce (max, no gradient) of the keys' per-feature maxima, then the exponentiated
  keys' sums ride along in the same all-reduce of kᵀv.

Local heads, the convolution and token shift read a few of the neighbours' tokens
(``exchange_boundaries``): one autograd-aware all-reduce of a (P, F) tensor, F the rank's
boundary entries (local heads: look_backward * w keys and values and their mask from the
previous rank, look_forward * w from the next; the convolution: its kernel_size - 1 inputs of
q, k and v; token shift: one token each way it shifts). Slice lengths must be multiples of
the local window and of ``blindspot_size`` (refused otherwise).

Bytes per layer and rank (``summary_bytes``): P b h (d (e + 1) + d_g + d) elements for causal
heads (d_g: 1 per-head decay, d per-feature, 0 without a gate; the last d only for
exponential features), b h d (e + [1: the normaliser column, unless the softmax map without a
gate] + [1: the softmax map's sums]) for non-causal heads, plus b h d for the softmax keys'
maxima (forward only); the halos on top. Backward sends as much again (the maxima aside).

``AutoregressiveWrapper``'s loss: rank r passes its n_local tokens and the one after them
(slices overlap by one token, so each boundary's target is counted once, by the rank that
predicts it) and returns its targets' summed loss over the whole sequence's count of targets:
one all-gather of 4 b + 1 integers (the slices' end tokens and mask entries, checked to
overlap, and the counts).

Only ``torch.distributed``: ``torch.distributed.nn.functional``'s autograd-aware all_reduce
(it warns that it is deprecated in favour of the functional collectives; the warning is
silenced here: its autograd form is the one this module needs).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .ops import CausalState, causal_linear_attention, linear_attention_readout
from .ops.causal.scan import Summary, scan

__all__ = [
    "ContextParallel",
    "causal_summary",
    "gather_summaries",
    "state_before",
    "context_parallel_causal_linear_attention",
    "noncausal_summary",
    "context_parallel_linear_attention",
    "summary_bytes",
    "exchange_boundaries",
]

NEG_INF = float("-inf")


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
    Build it with ``ContextParallel.of(group, batch, length)``: that checks (one all-gather
    of two integers) that every rank holds a slice of the same batch size and length.
    """

    __slots__ = ("group", "rank", "world_size", "length", "start")

    def __init__(self, group, rank, world_size, length):
        self.group, self.rank, self.world_size, self.length = group, rank, world_size, length
        self.start = rank * length

    def __repr__(self):
        return (f"ContextParallel(rank={self.rank}, world_size={self.world_size}, length={self.length}, "
                f"start={self.start})")

    @property
    def first(self):
        return self.rank == 0

    @property
    def last(self):
        return self.rank == self.world_size - 1

    @classmethod
    def of(cls, context_parallel, batch: int, length: int, device=None) -> "ContextParallel":
        """``context_parallel`` (a process group, or a ``ContextParallel`` already built for
        this slice) -> ``ContextParallel``. ``batch``, ``length``: this rank's slice (b, n_local).
        Raises TypeError for anything else, ValueError when the ranks' slices differ in batch
        size or length (on every rank alike: they all see the same gathered shapes)."""
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


def _exp_ratio(a, b):
    """exp(a - b) for a <= b (b a reference without gradient) that may be -inf: 0 there."""
    reached = torch.isfinite(b)
    return torch.where(reached, (a - torch.where(reached, b, torch.zeros_like(b))).exp(), torch.zeros_like(a))


# ------------------------------------------------------------------------- boundaries


def exchange_boundaries(parts, place: ContextParallel, before: int, after: int):
    """The neighbours' boundary tokens: for each (tensor, dim) of ``parts``, the previous
    rank's last ``before`` entries and the next rank's first ``after`` entries along ``dim``
    (zeros at the sequence's ends), with gradients back to the ranks they came from.

    One autograd-aware all-reduce of a (P, F) tensor, each rank's boundary entries (F of
    them, fixed: independent of the slice length) in its own slot.
    Args:
        parts: sequence of (tensor, dim); every tensor holds the slice's n_local tokens
            along ``dim`` (n_local >= before and >= after), the same shapes on every rank;
            a bool tensor (a mask) comes back as bool, with False at the sequence's ends.
        place: the slice's ``ContextParallel``. before, after: how many tokens each side.
    Returns:
        [(halo_before, halo_after)] per part: shaped like the tensor with ``before`` /
        ``after`` entries along ``dim``.
    """
    if before < 0 or after < 0:
        raise ValueError("before and after must be >= 0")
    dtype = torch.float32
    for t, _ in parts:
        if t.dtype != torch.bool:
            dtype = torch.promote_types(dtype, t.dtype)
    pieces, shapes = [], []
    for t, dim in parts:
        n = t.shape[dim]
        if n < before or n < after:
            raise ValueError(f"context_parallel: a slice of {n} tokens is shorter than the {max(before, after)} "
                             "boundary tokens its neighbours need; use fewer ranks or longer slices")
        head, tail = t.narrow(dim, 0, after), t.narrow(dim, n - before, before)
        for piece in (head, tail):
            shapes.append(piece.shape)
            pieces.append(piece.to(dtype).flatten())
    packed = torch.cat(pieces)[None]
    rank, world = place.rank, place.world_size
    slots = torch.cat((packed.new_zeros(rank, packed.shape[1]), packed, packed.new_zeros(world - rank - 1,
                                                                                         packed.shape[1])))
    gathered = _autograd_all_reduce(slots, place.group)
    # every rank reads some row of the result, even at the ends (times 0): the all-reduce
    # then takes part in every rank's backward, or the ranks that read it would wait forever
    previous = gathered[(rank - 1) % world] * float(rank > 0)
    following = gathered[(rank + 1) % world] * float(rank < world - 1)
    out, offset = [], 0
    for i, (t, dim) in enumerate(parts):
        head_size, tail_size = shapes[2 * i].numel(), shapes[2 * i + 1].numel()
        tail_prev = previous[offset + head_size : offset + head_size + tail_size].view(shapes[2 * i + 1])
        head_next = following[offset : offset + head_size].view(shapes[2 * i])
        offset += head_size + tail_size
        if t.dtype == torch.bool:
            tail_prev, head_next = tail_prev.detach() > 0.5, head_next.detach() > 0.5
        else:
            tail_prev, head_next = tail_prev.to(t.dtype), head_next.to(t.dtype)
        out.append((tail_prev, head_next))
    return out


# ----------------------------------------------------------------------------- causal


def causal_summary(k, v, log_decay=None, mask=None, exp_features=False) -> Summary:
    """The ``Summary`` of a slice of causal linear attention from a zero start, in O(n d e).

    Args:
        k: (b, h, n, d) key features, or logits with ``exp_features``.
        v: (b, h, n, e) values.
        log_decay: optional (b, h, n) or (b, h, n, d): log a_t <= 0 (a masked token's is
            ignored: padding does not decay the state).
        mask: optional (b, n) bool, True for real tokens.
        exp_features: the features are exp(k) (see ``ops/causal/chunk.py``).
    Returns:
        Summary(kv (b, h, d, e + 1) with the normaliser column last, log_decay (b, h, 1 or d)
        or None, ref (b, h, d) without gradient or None): what ``CausalState`` holds after
        the slice from a zero start (for exponential features relative to ``ref``).
        Computed in at least float32.
    """
    b, h, n, d = k.shape
    dtype = torch.promote_types(k.dtype, torch.float32)
    k, v = k.to(dtype), v.to(dtype)
    if mask is not None:
        m = mask[:, None, :, None]
        k = k.masked_fill(~m, NEG_INF if exp_features else 0.0)
        v = v.masked_fill(~m, 0.0)
    v = F.pad(v, (0, 1), value=1.0)
    total = to_end = None
    if log_decay is not None:
        ld = log_decay.to(dtype)
        ld = ld if ld.ndim == 4 else ld[..., None]  # (b, h, n, 1 or d)
        if mask is not None:
            ld = ld.masked_fill(~mask[:, None, :, None], 0.0)
        total = ld.sum(dim=2)  # (b, h, 1 or d)
        # the decay from each key to the slice's end, sum_{t > j} log a_t: an exclusive
        # reverse cumulative sum (no cancellation, every entry <= 0)
        later = torch.cat((torch.zeros_like(ld[:, :, :1]), ld.flip(2)[:, :, :-1]), dim=2)
        to_end = later.cumsum(dim=2).flip(2)
    if not exp_features:
        k_end = k if to_end is None else k * to_end.exp()
        return Summary(torch.einsum("bhnd,bhne->bhde", k_end, v), total, None)
    k_end = k if to_end is None else k + to_end
    with torch.no_grad():
        ref = k_end.detach().amax(dim=2)  # (b, h, d), -inf where no key
    kv = torch.einsum("bhnd,bhne->bhde", _exp_ratio(k_end, ref[:, :, None]), v)
    return Summary(kv, total, ref)


def gather_summaries(summary: Summary, group) -> Summary:
    """Every rank's ``Summary`` in rank order, with gradients back to the rank that made each.

    One autograd-aware all-reduce (sum) of a (P, …) tensor holding this rank's packed
    summary in its own slot and zeros elsewhere: the all-gather as a sum. Not
    ``torch.distributed.nn.functional.all_gather``: on gloo its backward scatters from the
    group ranks as if they were global ranks, and fails (or reads the wrong rank) in any
    group but the first ranks of the world, such as the context-parallel groups of a 2-D
    mesh. The all-reduce's backward is the all-reduce of the gradients, whose slot r is the
    gradient of rank r's summary summed over every rank's loss.

    Args:
        summary: this rank's Summary(kv (b, h, d, E), log_decay (b, h, g) or None,
            ref (b, h, d) or None); the same shapes on every rank.
        group: the process group.
    Returns:
        Summary of (P, b, h, …) tensors; ``ref`` without gradient.
    """
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kv, g, ref = summary
    b, h, d, e = kv.shape
    parts = [kv.flatten(2)]
    if g is not None:
        parts.append(g.to(kv.dtype))
    if ref is not None:
        parts.append(ref.detach().to(kv.dtype))
    packed = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])[None]  # (1, b, h, F)
    slots = torch.cat((packed.new_zeros((rank,) + packed.shape[1:]), packed,
                       packed.new_zeros((world - rank - 1,) + packed.shape[1:])), dim=0)
    gathered = _autograd_all_reduce(slots, group)  # (P, b, h, F)
    kv_all = gathered[..., : d * e].unflatten(-1, (d, e))
    offset = d * e
    g_all = ref_all = None
    if g is not None:
        g_all = gathered[..., offset : offset + g.shape[-1]]
        offset += g.shape[-1]
    if ref is not None:
        ref_all = gathered[..., offset : offset + d].detach()
    return Summary(kv_all, g_all, ref_all)


def state_before(summaries: Summary, rank: int, start: int = 0, blindspot_size: int = 1) -> CausalState:
    """The ``CausalState`` before rank ``rank``'s slice: the exclusive scan of the gathered
    summaries (``ops/causal/scan.py``'s ``scan``, over the rank axis 0), this rank's entry.

    The scan runs over all P ranks (P small) and this rank's entry is selected, so that the
    gather is part of every rank's backward, rank 0's included.
    Args:
        summaries: ``gather_summaries``' output, (P, b, h, …).
        rank: this rank. start: the position of the slice's first token.
        blindspot_size: B; the slices must then start at block boundaries (start a
            multiple of B), so that no block is pending.
    """
    if start % blindspot_size:
        raise ValueError(f"context_parallel: a slice must start at a blindspot block boundary (a multiple of "
                         f"blindspot_size={blindspot_size}), got start {start}")
    before, _ = scan(summaries, dim=0, drops=True)
    ref = None if before.ref is None else before.ref[rank]
    kv = before.kv[rank]
    if blindspot_size == 1:
        return CausalState(kv, ref, position=start)
    return CausalState(kv, ref, torch.zeros_like(kv), None if ref is None else torch.full_like(ref, NEG_INF), start)


def context_parallel_causal_linear_attention(q, k, v, place: ContextParallel, log_decay=None, mask=None,
                                             chunk_size=64, exp_features=False, blindspot_size=1):
    """``causal_linear_attention`` on this rank's slice of a sequence split over
    ``place.group``: equal to the whole sequence's output at the slice's positions.

    Args:
        q, k: (b, h, n_local, d) features, or logits with ``exp_features``.
        v: (b, h, n_local, e).
        place: the slice's ``ContextParallel``.
        log_decay: optional (b, h, n_local) or (b, h, n_local, d).
        mask: optional (b, n_local) bool. chunk_size: the kernel's chunk length.
        blindspot_size: B (n_local a multiple of B): a query sees the keys of earlier blocks.
    Returns:
        (b, h, n_local, e)
    """
    if place.length % blindspot_size:
        raise ValueError(f"context_parallel: the slice length ({place.length}) must be a multiple of "
                         f"blindspot_size ({blindspot_size})")
    summaries = gather_summaries(causal_summary(k, v, log_decay, mask, exp_features), place.group)
    state = state_before(summaries, place.rank, place.start, blindspot_size)
    return causal_linear_attention(q, k, v, log_decay, mask, blindspot_size=blindspot_size, chunk_size=chunk_size,
                                   exp_features=exp_features, state=state)


# ------------------------------------------------------------------------- non-causal


def noncausal_summary(k, v, group, mask=None, normalize=True, softmax_keys=False, key_scale=None):
    """kᵀv of the whole sequence's keys (``linear_attention_summary``'s result), from this
    rank's slice of them: one all-reduce (autograd-aware, sum) of the slice's kᵀv.

    Args:
        k: (b, h, n_local, d) key features, or with ``softmax_keys`` key logits that take a
            softmax over the whole sequence (the softmax feature map without a causal order;
            masked keys then take no part in it unless every key is masked, as in
            ``FeatureMap.noncausal_keys``).
        v: (b, h, n_local, e). group: the process group.
        mask: optional (b, n_local) bool, True for keys to attend to.
        normalize: append the normaliser column (as ``linear_attention_summary``).
        key_scale: optional factor on each key's features after the softmax, broadcastable
            to k (a forget gate's values without a causal order).
    Returns:
        (kv (b, h, d, e [+ 1]), normalize): the summary ``linear_attention_readout`` reads.
    """
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
    if keep is not None:
        k, v = k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)
    if normalize:
        v = F.pad(v, (0, 1), value=1.0)
    kv = torch.einsum("bhnd,bhne->bhde", k, v)
    if z is None:
        return _autograd_all_reduce(kv, group), normalize
    total = _autograd_all_reduce(torch.cat((kv, z[..., None]), dim=-1), group)
    return total[..., :-1] / total[..., -1:], normalize


def context_parallel_linear_attention(q, k, v, place: ContextParallel, mask=None, normalize=True,
                                      softmax_keys=False, key_scale=None):
    """Non-causal linear attention of this rank's queries over the whole sequence's keys.

    Args:
        q: (b, h, n_local, d) query features. k, v, mask, normalize, softmax_keys,
            key_scale: as ``noncausal_summary``. place: the slice's ``ContextParallel``.
    Returns:
        (b, h, n_local, e)
    """
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
