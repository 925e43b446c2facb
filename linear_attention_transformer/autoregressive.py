"""Autoregressive wrapper: next-token loss for training, sampling loop for generation.

The wrapped ``net`` is any language model with the call signature

    net(x, input_mask=None, **kwargs) -> logits

with ``x`` a (b, n) integer tensor, ``input_mask`` an optional (b, n) bool tensor
(True for real tokens) and ``logits`` a (b, n, num_tokens) float tensor, and with an
int attribute ``max_seq_len``: the longest sequence it accepts, unless it also has an attribute
``length_limit``, which is then that length (None: any length).

A net whose logits are a final ``nn.Linear`` of some features may expose both,

    net.output_features(x, input_mask=None, **kwargs) -> features (b, n, e)
    net.output_layer -> nn.Linear(e, num_tokens), with net(x, ...) == output_layer(features)

and the training loss is then taken chunk by chunk along the sequence (``linear_cross_entropy``)
without ever holding the (b, n, num_tokens) logits. Any other net gets the plain
``F.cross_entropy`` of its logits.

A net that can decode incrementally also sets ``supports_cache = True`` and accepts

    net(x, cache=cache, return_cache=True, input_mask=..., **kwargs) -> (logits, cache)

where ``cache=None`` means "start from nothing" and otherwise ``x`` holds only the
tokens that follow those already in ``cache`` (see ``AutoregressiveWrapper.generate``):
``generate`` reads the prompt with ``**kwargs`` and then feeds one token per row with the
cache alone. A net whose one-token call compiles as one graph sets ``step_compiles = True``
(``generate(..., compile_step=...)`` compiles that call; on CUDA the tensors of the cache's
``static_tensors()``, if it has them, are marked as static addresses first).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch
import torch.nn.functional as F
from torch import nn

from .context_parallel import ContextParallel
from .lm import check_token_ids
from .ops.common import check_mask
from .ops.segments import check_integer_ids, check_segment_ids, is_integer_dtype
from .place import check_modes

__all__ = ["top_k", "top_p", "linear_cross_entropy", "AutoregressiveWrapper"]

# the filters' default threshold, and generate's
FILTER_THRES = 0.9


def _check_thres(thres, name="thres"):
    if isinstance(thres, bool) or not isinstance(thres, Real):
        raise TypeError(f"{name} must be a real number in [0, 1), got {thres!r}")
    if not 0.0 <= thres < 1.0:
        raise ValueError(f"{name} must lie in [0, 1), got {thres!r}")


def _check_logits(logits):
    if not torch.is_tensor(logits) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating point tensor, got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if torch.is_tensor(logits) else ""))
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., num_tokens) with num_tokens >= 1, "
                         f"got {tuple(logits.shape)}")


def _check_compile_step(compile_step):
    """None (False) or the keyword arguments for ``torch.compile`` of the net's one-token call."""
    if compile_step is False or compile_step is None:
        return None
    if compile_step is True:
        return {}
    if isinstance(compile_step, dict) and all(isinstance(key, str) for key in compile_step):
        return dict(compile_step)
    raise TypeError(f"compile_step must be False, True or a dict of torch.compile keyword arguments, "
                    f"got {compile_step!r}")


def top_k(logits, thres=FILTER_THRES):
    """Keep the k largest logits, set the others to -inf: logits (..., num_tokens) float (not
    modified) -> a tensor of the same shape and dtype. thres: float in [0, 1).

    k = ceil((1 - thres) * num_tokens), at least 1: ``thres=0.9`` keeps the top 10 %. The
    product is rounded to 9 decimals before the ceiling (0.3 * 10 is 3.0000000000000004 in
    floats). Exactly k tokens are kept, ties broken as ``torch.topk`` breaks them.
    """
    _check_logits(logits)
    _check_thres(thres)
    return _keep_largest(logits, math.ceil(round((1.0 - thres) * logits.shape[-1], 9)))


def _keep_largest(logits, k):
    """The k (clamped to [1, num_tokens]) largest logits kept, the others set to -inf."""
    k = min(max(k, 1), logits.shape[-1])
    values, indices = logits.topk(k, dim=-1)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, indices, values)


def _sampling_filter(filter_logits_fn, filter_thres, k, p):
    """The filter ``generate`` applies to the logits before sampling: f(logits) -> logits, or
    None. ``k``, ``p``: generate's ``top_k`` and ``top_p`` (see there)."""
    if k is None and p is None:
        if filter_logits_fn is not None and not callable(filter_logits_fn):
            raise TypeError(f"filter_logits_fn must be callable or None, got {filter_logits_fn!r}")
        _check_thres(filter_thres, "filter_thres")
        if filter_logits_fn is None:
            return None
        return lambda logits: filter_logits_fn(logits, thres=filter_thres)
    if filter_logits_fn is not top_k or filter_thres != FILTER_THRES:
        raise ValueError("top_k / top_p and filter_logits_fn / filter_thres are two ways to give the sampling "
                         "filter: give one of them")
    if k is not None and (isinstance(k, bool) or not isinstance(k, Integral)):
        raise TypeError(f"top_k must be an int (how many of the most likely tokens to keep), got {k!r}")
    if k is not None and k < 1:
        raise ValueError(f"top_k must be >= 1 (None keeps every token), got {k}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, Real)):
        raise TypeError(f"top_p must be a real number in (0, 1], got {p!r}")
    if p is not None and not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 keeps every token), got {p}")

    def keep_top_k_top_p(logits):
        if k is not None:
            logits = _keep_largest(logits, int(k))
        if p is not None and p < 1.0:
            logits = top_p(logits, thres=p)
        return logits

    return keep_top_k_top_p


def top_p(logits, thres=FILTER_THRES):
    """Nucleus filter: keep the smallest set of most likely tokens whose probability
    mass reaches ``thres``, set the others to -inf.

    Tokens are taken in order of decreasing probability (softmax of ``logits``) while
    the mass taken so far is below ``thres``; the token that brings it to ``thres`` or
    beyond is kept (so ``thres=0`` keeps only the most likely). Probabilities in at least
    float32. Arguments and result as ``top_k``'s.
    """
    _check_logits(logits)
    _check_thres(thres)
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.to(compute_dtype).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    keep_sorted = mass_before < thres
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


# logits held at once by linear_cross_entropy: rows per chunk = this // num_tokens. On the CPU
# 2**22 (16 MiB of float32 logits, near the caches); on other devices a chunk costs its ~15
# launches whatever its size, so fewer, larger chunks: 2**25 (128 MiB). At n = 65536 and 20000
# tokens that is 40 chunks instead of 313.
LOSS_CHUNK_ELEMENTS = 2 ** 22
LOSS_CHUNK_ELEMENTS_ACCELERATOR = 2 ** 25


def loss_chunk_elements(device):
    """The logits ``linear_cross_entropy`` holds at once by default on ``device``."""
    return LOSS_CHUNK_ELEMENTS if torch.device(device).type == "cpu" else LOSS_CHUNK_ELEMENTS_ACCELERATOR


def linear_cross_entropy(features, weight, bias, targets, ignore_index=-100, chunk_rows=None, total_count=None):
    """Mean cross-entropy of the logits ``F.linear(features, weight, bias)`` against ``targets``,
    without holding those logits: rows are taken ``chunk_rows`` at a time.

    The plain form is ``F.cross_entropy(F.linear(features, weight, bias), targets,
    ignore_index=ignore_index)``; it keeps the (N, num_tokens) logits and their softmax for
    backward. Here each chunk's logits are formed, reduced to its loss and, when gradients are
    wanted, straight away to the gradients of the chunk's features, the weight and the bias
    (with p = softmax(logits) - onehot(target) on counted rows, 0 on the others: dfeatures =
    p W, dW = pᵀ features, db = Σ p); the chunk's logits are then dropped. Backward only scales
    those gradients: no logits are recomputed, and the matmul work is that of the plain form.
    The log-sum-exp runs in at least float32 (also under autocast).

    Args:
        features: (N, e) float. weight: (num_tokens, e). bias: (num_tokens,) or None.
        targets: (N,) integer; entries equal to ``ignore_index`` are not counted.
        chunk_rows: rows per chunk (default ``loss_chunk_elements(device) // num_tokens``, >= 1).
        total_count: what the summed loss is divided by: None (the default) for the rows
            counted here; an integer tensor (no gradient) or int otherwise, e.g. the counted
            rows of a whole sequence whose rows are split over processes.
    Returns:
        scalar: the summed loss of the counted rows over ``total_count`` (by default their
        mean, NaN when none is counted, as F.cross_entropy).
    """
    if features.ndim != 2 or weight.ndim != 2 or features.shape[1] != weight.shape[1]:
        raise ValueError(f"features (N, e) and weight (num_tokens, e) must agree, got "
                         f"{tuple(features.shape)} and {tuple(weight.shape)}")
    if targets.shape != features.shape[:1]:
        raise ValueError(f"targets must have shape ({features.shape[0]},), got {tuple(targets.shape)}")
    if chunk_rows is None:
        chunk_rows = max(1, loss_chunk_elements(features.device) // weight.shape[0])
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, Integral) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    # forming the gradients costs two matmuls per chunk: only when backward can use them
    if total_count is not None:
        if isinstance(total_count, bool) or not (isinstance(total_count, Integral) or (
                torch.is_tensor(total_count) and total_count.ndim == 0 and is_integer_dtype(total_count.dtype))):
            raise TypeError(f"total_count must be None, an int or a 0-d integer tensor, got {total_count!r}")
        total_count = torch.as_tensor(total_count, device=features.device)
    want_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (features, weight, bias))
    return _LinearCrossEntropy.apply(features, weight, bias, targets, int(ignore_index), int(chunk_rows), want_grad,
                                     total_count)


class _LinearCrossEntropy(torch.autograd.Function):
    """``linear_cross_entropy``: gradients formed in forward, chunk by chunk, scaled in backward."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, ignore_index, chunk_rows, want_grad, total_count=None):
        device_type = features.device.type
        matmul_dtype = features.dtype
        if torch.is_autocast_enabled(device_type):
            matmul_dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            h, w = features.to(matmul_dtype), weight.to(matmul_dtype)
            b = None if bias is None else bias.to(matmul_dtype)
            counted = targets != ignore_index
            safe_targets = targets.masked_fill(~counted, 0).long()
            total = features.new_zeros((), dtype=torch.promote_types(features.dtype, torch.float32))
            if want_grad:
                grad_h = torch.empty_like(features)
                grad_w = torch.zeros_like(weight, dtype=total.dtype)
                grad_b = None if bias is None else torch.zeros_like(bias, dtype=total.dtype)
            n_rows = features.shape[0]
            # one chunk as a whole slice: under torch.compile with dynamic shapes the loop over a
            # symbolic row count would specialise on it (a recompile per length), a comparison
            # only guards on n_rows <= chunk_rows
            chunks = [slice(None)] if n_rows <= chunk_rows else [
                slice(start, start + chunk_rows) for start in range(0, n_rows, chunk_rows)]
            for rows in chunks:
                logits = F.linear(h[rows], w, b).to(total.dtype)
                picked = logits.gather(1, safe_targets[rows, None])[:, 0]
                # log-sum-exp by hand, in place, so that exp(logits - max) serves the softmax too
                top = logits.amax(dim=-1, keepdim=True)
                e = logits.sub_(top).exp_()
                sums = e.sum(dim=-1)
                lse = top[:, 0] + sums.log()
                total = total + ((lse - picked) * counted[rows]).sum()
                if want_grad:
                    # softmax - onehot on counted rows, 0 on the others: the rows are scaled by
                    # counted / sums in the one pass that divides by the sums (no check whether
                    # any row is ignored: that would read a value back to the host)
                    weight_row = counted[rows].to(e.dtype)
                    p = e.mul_((weight_row / sums)[:, None])
                    p[torch.arange(p.shape[0], device=p.device), safe_targets[rows]] -= weight_row
                    p = p.to(matmul_dtype)
                    grad_h[rows] = (p @ w).to(grad_h.dtype)
                    grad_w += (p.t() @ h[rows]).to(grad_w.dtype)
                    if grad_b is not None:
                        grad_b += p.sum(dim=0).to(grad_b.dtype)
            count = counted.sum() if total_count is None else total_count
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                                  count)
        return (total / count).to(features.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b, count = ctx.saved_tensors
        scale = grad_loss / count
        grads = [None if g is None else g * scale.to(g.dtype) for g in (grad_h, grad_w, grad_b)]
        return (*grads, None, None, None, None, None)


def _lengths(tokens, eos_token):
    """Each row's length in ``generate``'s output (..., steps): its tokens up to and including
    its first ``eos_token`` (the later ones are padding), all of them if it has none."""
    steps = tokens.shape[-1]
    if eos_token is None:
        return torch.full(tokens.shape[:-1], steps, dtype=torch.long, device=tokens.device)
    is_eos = tokens == eos_token
    first = is_eos.long().argmax(dim=-1)  # the first maximum: the first eos, when there is one
    return torch.where(is_eos.any(dim=-1), first + 1, torch.full_like(first, steps))


class AutoregressiveWrapper(nn.Module):
    """Wraps a language model for next-token training and for sampling.

    Args:
        net: a language model as the module docstring describes.
        ignore_index: target value that the loss ignores (as in ``F.cross_entropy``).
        pad_value: token written after a row's end-of-sequence token in ``generate``.
    """

    def __init__(self, net, ignore_index=-100, pad_value=0):
        super().__init__()
        max_seq_len = getattr(net, "max_seq_len", None)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, Integral) or max_seq_len < 1:
            raise ValueError(f"net must have a positive int attribute max_seq_len, got {max_seq_len!r}")
        for name, value in (("ignore_index", ignore_index), ("pad_value", pad_value)):
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
        self.net = net
        self.max_seq_len = int(max_seq_len)
        limit = getattr(net, "length_limit", self.max_seq_len)
        # the longest window generate feeds the net (None: the whole sequence, streamed through the cache)
        self.length_limit = None if limit is None else int(limit)
        self.ignore_index = int(ignore_index)
        self.pad_value = int(pad_value)

    def forward(self, x, return_loss=True, **kwargs):
        """Next-token cross-entropy, or the net's output.

        Args:
            x: (b, n) integer tokens. With ``return_loss`` n >= 2: the net reads
                x[:, :-1] and is scored on predicting x[:, 1:].
            return_loss: False returns ``self.net(x, **kwargs)`` unchanged.
            **kwargs: passed to the net. ``input_mask`` (b, n) bool, True for real
                tokens, is cut to (b, n - 1) for the net, and targets whose token is
                masked out are ignored in the loss. ``segment_ids`` (b, n) (packed
                sequences) is cut the same way, and a target that starts a new segment is
                ignored: predicting it would cross the boundary.
                ``context_parallel``: a process group over which one sequence is split; rank r
                passes its n_local tokens and the one after them, and gets its part of the
                whole sequence's mean (docs/scale.md, "Context parallelism").
        Returns:
            scalar loss: mean over the targets that are neither ``ignore_index`` nor
            masked out (NaN when there are none, as with ``F.cross_entropy``);
            or the net's output when ``return_loss`` is False. A net with
            ``output_features`` / ``output_layer`` (see the module docstring) gets the same
            loss from ``linear_cross_entropy``, without the (b, n - 1, num_tokens) logits.
        """
        if not return_loss:
            return self.net(x, **kwargs)
        context_parallel = kwargs.pop("context_parallel", None)
        check_modes(packed=kwargs.get("segment_ids") is not None, parallel=context_parallel is not None)

        check_integer_ids(x, "x")
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(f"x must have shape (batch, seq_len) with seq_len >= 2 to compute "
                             f"the loss, got {tuple(x.shape)}")
        inputs, targets = x[:, :-1], x[:, 1:].long()  # long: ignore_index may not fit x's dtype

        mask = kwargs.pop("input_mask", None)
        if mask is not None:
            check_mask(mask, *x.shape, "input_mask")
            kwargs["input_mask"] = mask[:, :-1]
            targets = targets.masked_fill(~mask[:, 1:], self.ignore_index)
        segment_ids = kwargs.pop("segment_ids", None)
        if segment_ids is not None:
            check_segment_ids(segment_ids, x.shape)
            kwargs["segment_ids"] = segment_ids[:, :-1]
            targets = targets.masked_fill(segment_ids[:, 1:] != segment_ids[:, :-1], self.ignore_index)

        total_count = None
        if context_parallel is not None:
            kwargs["context_parallel"], total_count = self._context_parallel_count(
                context_parallel, x, mask, targets)

        layer = self._output_layer()
        if layer is None:
            logits = self.net(inputs, **kwargs)
            # rows of (b * n, num_tokens): a softmax along contiguous memory, unlike (b, num_tokens, n)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=self.ignore_index, reduction="mean" if total_count is None else "sum")
            return loss if total_count is None else loss / total_count
        features = self.net.output_features(inputs, **kwargs)
        return linear_cross_entropy(features.reshape(-1, features.shape[-1]), layer.weight, layer.bias,
                                    targets.reshape(-1), self.ignore_index, total_count=total_count)

    @torch.no_grad()
    def stream_loss(self, tokens, chunk_len=None, reduction="mean"):
        """Next-token cross-entropy (nats) of a text of any length, read in one stream through
        the net's cache: bits per character are this over ln 2.

        The net reads tokens[:, :-1] ``chunk_len`` tokens at a time, each chunk continuing the
        cache the ones before it left (``net(chunk, cache=cache, return_cache=True)``), and is
        scored on predicting tokens[:, 1:]. The cache has a fixed size and one chunk's logits
        are held at a time, so the memory does not grow with n (but for the (b, n - 1) result of
        ``reduction="none"``). Where the net can read the whole text at once the figures are those
        of ``forward`` (``return_loss=True``), up to rounding. Runs without gradients, in eval
        mode (each module's training flag is restored after).

        Args:
            tokens: (b, n) integer tokens, n >= 2.
            chunk_len: tokens the net reads per call, a positive int (default ``max_seq_len``).
                Any value gives the same figures; it sizes the compute and the logits held.
            reduction: "mean" (a scalar over the b (n - 1) targets) or "none" ((b, n - 1): entry
                t is the loss of predicting tokens[:, t + 1], to read position ranges).
        Raises:
            ValueError: the net has no cache (``supports_cache``), or reads at most
                ``length_limit`` tokens (a position table) and the text is longer.
        """
        check_integer_ids(tokens, "tokens")
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must have shape (batch, n) with n >= 2, got {tuple(tokens.shape)}")
        if chunk_len is None:
            chunk_len = self.max_seq_len
        if isinstance(chunk_len, bool) or not isinstance(chunk_len, Integral):
            raise TypeError(f"chunk_len must be an int (tokens read per call), got {chunk_len!r}")
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        if not self._supports_cache():
            raise ValueError("stream_loss reads the text through the net's cache, and this net has none (no "
                             "supports_cache = True: a causal model without Linformer has one); score windows "
                             "with forward(x, return_loss=True) instead")
        reads = tokens.shape[1] - 1
        if self.length_limit is not None and reads > self.length_limit:
            raise ValueError(f"tokens: the net reads {reads} of them (n - 1), past its length_limit="
                             f"{self.length_limit}, the length of its position table; a model with rotary "
                             f"positions (use_rotary_emb=True) or none (use_pos_emb=False) reads any length")

        modes = [(module, module.training) for module in self.net.modules()]
        self.net.eval()
        try:
            cache, losses = None, []
            for start in range(0, reads, int(chunk_len)):
                chunk = tokens[:, start:min(start + int(chunk_len), reads)]
                logits, cache = self.net(chunk, cache=cache, return_cache=True)
                targets = tokens[:, start + 1:start + 1 + chunk.shape[1]].long()
                loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
                losses.append(loss if reduction == "none" else loss.sum(dtype=torch.float64))
        finally:
            for module, training in modes:
                module.training = training
        if reduction == "none":
            return torch.cat(losses, dim=1)
        return (sum(losses) / (tokens.shape[0] * reads)).to(loss.dtype)

    def _context_parallel_count(self, context_parallel, x, mask, targets):
        """(the net's ``ContextParallel`` for x[:, :-1], the counted targets of all ranks): one
        all-gather of each rank's first and last tokens (and mask entries) and its count, which
        checks that neighbouring slices overlap by one token. x, mask: (b, n_local + 1);
        targets: (b, n_local), ``ignore_index`` where not counted."""
        place = ContextParallel.of(context_parallel, x.shape[0], x.shape[1] - 1, x.device)
        ends = [x[:, 0], x[:, -1]]
        ends += [x.new_ones(x.shape[0]), x.new_ones(x.shape[0])] if mask is None else [mask[:, 0], mask[:, -1]]
        count = (targets != self.ignore_index).sum()
        mine = torch.cat([t.long() for t in ends] + [count[None]])  # (4 b + 1,)
        gathered = [torch.empty_like(mine) for _ in range(place.world_size)]
        torch.distributed.all_gather(gathered, mine, group=place.group)
        b = x.shape[0]
        for r in range(place.world_size - 1):
            last, first = gathered[r], gathered[r + 1]
            if not (torch.equal(last[b : 2 * b], first[:b]) and torch.equal(last[3 * b : 4 * b], first[2 * b : 3 * b])):
                raise ValueError(f"x: with context_parallel each rank passes its n_local tokens and the token that "
                                 f"follows them (n_local + 1 = {x.shape[1]}), so that rank r's last token (and "
                                 f"input_mask entry) is rank r + 1's first; ranks {r} and {r + 1} differ")
        return place, sum(g[-1] for g in gathered)

    def _output_layer(self):
        """The net's final Linear when it also exposes the features it reads (see the module
        docstring), for the chunked loss; otherwise None."""
        layer = getattr(self.net, "output_layer", None)
        if isinstance(layer, nn.Linear) and callable(getattr(self.net, "output_features", None)):
            return layer
        return None

    def _supports_cache(self):
        return getattr(self.net, "supports_cache", False) is True

    def _one_token_call(self, options, cache):
        """f(x (b, 1), cache) -> (logits (b, num_tokens), cache): the net's call with one token per row,
        compiled as ``generate``'s compile_step says (``options``: None, or keyword arguments
        for ``torch.compile``); ``cache``: the first one it will step."""
        net = self.net

        def one_token(x, cache):
            logits, cache = net(x, cache=cache, return_cache=True)
            return logits[:, -1], cache

        if options is None:
            return one_token
        if getattr(net, "step_compiles", False) is not True:
            raise ValueError(f"compile_step: the net ({type(net).__name__}) has no one-token call that compiles as "
                             f"one graph; pass compile_step=False")
        options = {"fullgraph": True, **options}
        device = next(iter(net.parameters()), torch.empty(0)).device
        if device.type == "cuda" and "mode" not in options and "backend" not in options:
            options["mode"] = "reduce-overhead"
        static = getattr(cache, "static_tensors", None)
        if device.type == "cuda" and static is not None:  # (a CUDA graph then reads them where they are)
            for tensor in static():
                torch._dynamo.mark_static_address(tensor)
        return torch.compile(one_token, **options)

    def _next_logits(self, seq, mask, cache_state, kwargs):
        """Logits (b, num_tokens) for the token that follows ``seq`` (b, n), the running
        sequence (``mask``: its input mask or None). ``cache_state``: None to recompute; else a
        dict this updates: ``cache`` (the net's, None at first: it covers every token of ``seq``
        but the newest, which the previous call appended), ``compile`` (compile_step's options)
        and ``step`` (the one-token call)."""
        n = seq.shape[1]
        window = n if self.length_limit is None else self.length_limit
        net_kwargs = dict(kwargs)
        if cache_state is None:
            if mask is not None:
                net_kwargs["input_mask"] = mask[:, -window:]
            logits = self.net(seq[:, -window:], **net_kwargs)
            return logits[:, -1]

        cache = cache_state["cache"]
        if cache is not None and n <= window:
            # the newest token is real: no mask to pass (contiguous: the column of the running
            # buffer has its row stride, which would differ between calls and make a compiled
            # call guard on it)
            logits, cache_state["cache"] = cache_state["step"](seq[:, -1:].contiguous(), cache)
            return logits
        # The cache can only grow: once the running sequence is longer than a net's
        # length_limit, dropping its oldest token means building the cache anew from the last window.
        start = max(n - window, 0)
        if mask is not None:
            net_kwargs["input_mask"] = mask[:, start:]
        logits, cache = self.net(seq[:, start:], return_cache=True, **net_kwargs)
        if cache_state.get("step") is None:
            cache_state["step"] = self._one_token_call(cache_state["compile"], cache)
        cache_state["cache"] = cache
        return logits[:, -1]

    def generate(self, start_tokens, seq_len, eos_token=None, temperature=1.0,
                 filter_logits_fn=top_k, filter_thres=FILTER_THRES, use_cache=None, compile_step=False,
                 top_k=None, top_p=None, return_lengths=False, **kwargs):
        """Sample ``seq_len`` tokens that continue ``start_tokens`` (docs/training.md, "Generation").

        Each step feeds the net the last ``net.max_seq_len`` tokens of the running
        sequence (the prompt followed by the tokens generated so far), takes the logits
        at the last position and picks the next token: greedily (argmax) when
        ``temperature`` is 0, otherwise by ``torch.multinomial`` from
        ``softmax(filter_logits_fn(logits, thres=filter_thres) / temperature)``.

        Args:
            start_tokens: (n,) or (b, n) integer prompt, n >= 1. Not modified.
            seq_len: number of tokens to generate, >= 1.
            eos_token: optional end-of-sequence token. A row that has produced it gets
                ``pad_value`` at every later position of the output, and generation stops
                as soon as every row has produced it (the output then has fewer columns).
                The net keeps reading the finished rows' own picks, never ``pad_value``.
            temperature: float >= 0; 0 means greedy decoding (no filter is applied).
            filter_logits_fn: ``f(logits (b, num_tokens), thres=filter_thres)`` returning
                filtered logits, e.g. ``top_k`` or ``top_p``; None samples from the full
                distribution. filter_thres: float in [0, 1), passed to it.
            top_k, top_p: the filter as other libraries take it, instead of the two above
                (which must then keep their defaults): ``top_k`` an int >= 1, the k most likely
                tokens; ``top_p`` a float in (0, 1], the nucleus (1: no filter); both: the
                nucleus among the k.
            return_lengths: also return each row's length: its generated tokens up to and
                including its first ``eos_token`` (all of them if it has none).
            use_cache: None uses the net's cache (the prompt read once, then one token per
                row a call) when it declares ``supports_cache = True``; True requires it; False
                recomputes the window every step. A net with a ``length_limit`` (a position
                table) reads the last ``length_limit`` tokens: once the sequence outgrows it
                the cache is rebuilt from them at every step. Without one (rotary or no
                positions) the cache streams on at a constant cost per token.
            compile_step: False runs the net's one-token call eagerly; True, or a dict of
                ``torch.compile`` keyword arguments, compiles it with ``fullgraph=True`` and
                the options (one graph for every position; on CUDA with
                ``mode="reduce-overhead"`` unless the dict names a mode or a backend). Needs
                the cache and a net with ``step_compiles``. On a CPU it may not pay.
            **kwargs: passed to the net. ``input_mask`` (b, n) (or (n,) for a 1-D
                prompt) bool, True for real tokens, describes left-padded prompts: its
                last column must be all True. It is extended with True for each
                generated token and cut to the same window as the tokens.
        Returns:
            (b, steps) generated tokens only, in the dtype of ``start_tokens``, or
            (steps,) for a 1-D prompt. With ``return_lengths``: (tokens, lengths), lengths
            (b,) int64 (0-d for a 1-D prompt); ``tokens[i, :lengths[i]]`` is row i's text.

        The net runs in eval mode (every module's training flag is restored afterwards, also
        on an error) and under ``torch.inference_mode``: tensors captured inside (by hooks,
        say) are inference tensors.
        """
        # inference mode: less overhead per decoding step than no_grad; the
        # result is cloned outside it so that callers may feed it to a model they train
        with torch.inference_mode():
            sample_filter = _sampling_filter(filter_logits_fn, filter_thres, top_k, top_p)
            if not isinstance(return_lengths, bool):
                raise TypeError(f"return_lengths must be True or False, got {return_lengths!r}")
            out = self._generate(start_tokens, seq_len, eos_token, temperature, sample_filter, use_cache,
                                 compile_step, **kwargs)
            if return_lengths:
                return out.clone(), _lengths(out, eos_token)
        return out.clone()

    def _generate(self, start_tokens, seq_len, eos_token, temperature, sample_filter, use_cache, compile_step,
                  **kwargs):
        """``generate`` without the inference-mode wrapper; ``sample_filter`` from ``_sampling_filter``."""
        check_integer_ids(start_tokens, "start_tokens")
        if start_tokens.ndim not in (1, 2) or start_tokens.shape[-1] < 1:
            raise ValueError(f"start_tokens must have shape (n,) or (batch, n) with n >= 1, "
                             f"got {tuple(start_tokens.shape)}")
        num_tokens = getattr(self.net, "num_tokens", None)
        if isinstance(num_tokens, Integral):
            check_token_ids(start_tokens, num_tokens, "start_tokens")
            if torch.iinfo(start_tokens.dtype).max < num_tokens - 1:  # (the output keeps that dtype)
                raise ValueError(f"start_tokens of dtype {start_tokens.dtype} cannot hold the token ids up to "
                                 f"{num_tokens - 1} that generate may return; pass them as int32 or int64")
        if isinstance(seq_len, bool) or not isinstance(seq_len, Integral):
            raise TypeError(f"seq_len must be an int, got {seq_len!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(temperature, bool) or not isinstance(temperature, Real):
            raise TypeError(f"temperature must be a real number, got {temperature!r}")
        if not temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 for greedy), got {temperature}")
        if eos_token is not None and (isinstance(eos_token, bool) or not isinstance(eos_token, Integral)):
            raise TypeError(f"eos_token must be an int or None, got {eos_token!r}")
        if use_cache is not None and not isinstance(use_cache, bool):
            raise TypeError(f"use_cache must be None, True or False, got {use_cache!r}")
        if use_cache and not self._supports_cache():
            raise ValueError("use_cache=True but the net does not support a cache "
                             "(it has no attribute supports_cache set to True); "
                             "pass use_cache=False or None")
        if use_cache is None:
            use_cache = self._supports_cache()
        compile_options = _check_compile_step(compile_step)
        if compile_options is not None and not use_cache:
            raise ValueError("compile_step compiles the net's one-token call with the cache: it needs use_cache True "
                             "or None; pass compile_step=False")

        if kwargs.get("context_parallel") is not None:
            raise ValueError("context_parallel: generate continues one sequence on one rank; "
                             "call it without context_parallel")
        if kwargs.get("segment_ids") is not None:
            raise ValueError("segment_ids: generate continues one sequence per row; "
                             "packed prompts are not supported (generate each document on its own)")
        was_1d = start_tokens.ndim == 1
        seq = start_tokens[None] if was_1d else start_tokens
        mask = kwargs.pop("input_mask", None)
        if mask is not None:
            if was_1d and torch.is_tensor(mask):
                mask = mask[None]
            check_mask(mask, *seq.shape, "input_mask")
            if not bool(mask[:, -1].all()):
                raise ValueError("input_mask must be True at the last prompt position of every "
                                 "row (pad prompts on the left)")

        b, device, dtype = seq.shape[0], seq.device, seq.dtype
        # the running sequence (and mask) live in buffers of the final length, written one
        # column per step: no step copies the whole sequence so far
        length = seq.shape[1]
        seq_buffer = seq.new_empty(b, length + seq_len)
        seq_buffer[:, :length] = seq
        seq = seq_buffer[:, :length]
        if mask is not None:
            mask_buffer = mask.new_ones(b, length + seq_len)
            mask_buffer[:, :length] = mask
            mask = mask_buffer[:, :length]
        done = torch.zeros(b, dtype=torch.bool, device=device)
        cache_state = {"cache": None, "compile": compile_options} if use_cache else None
        generated = []

        modes = [(module, module.training) for module in self.net.modules()]
        self.net.eval()
        try:
            for _ in range(seq_len):
                logits = self._next_logits(seq, mask, cache_state, kwargs)
                if logits.dtype.itemsize < 4:  # (half precision: sampled in float32)
                    logits = logits.float()

                if temperature == 0:
                    token = logits.argmax(dim=-1)
                else:
                    if sample_filter is not None:
                        logits = sample_filter(logits)
                    probs = F.softmax(logits / temperature, dim=-1)
                    token = torch.multinomial(probs, 1).squeeze(-1)
                if token.dtype != dtype:
                    token = token.to(dtype)

                # The running sequence keeps what was picked, also for rows already
                # finished (their later picks are discarded), so the net never has to
                # read pad_value, which need not be a valid token.
                seq_buffer[:, length] = token
                length += 1
                seq = seq_buffer[:, :length]
                if eos_token is not None:
                    token = token.masked_fill(done, self.pad_value)
                    done = done | (token == eos_token)
                generated.append(token)
                if mask is not None:
                    mask = mask_buffer[:, :length]  # generated tokens are real: the buffer holds True
                if eos_token is not None and bool(done.all()):
                    break
        finally:
            for module, training in modes:
                module.training = training

        out = torch.stack(generated, dim=1)
        return out[0] if was_1d else out
