"""Residual block stacks: a plain one and a reversible (RevNet / Reformer) one.

Both stacks take the same ``blocks``: a sequence of ``(f, g)`` pairs of modules,
typically ``f`` = (pre-norm) attention and ``g`` = (pre-norm) feed-forward. Each of
``f(x, **kwargs)`` and ``g(x, **kwargs)`` returns a tensor shaped like ``x``.

``SequentialSequence`` is the ordinary pre-norm residual stack::

    for f, g in blocks:
        x = x + f(x, **kwargs)
        x = x + g(x, **kwargs)

``ReversibleSequence`` runs two residual streams, both starting at ``x``::

    x1 = x2 = x
    for f, g in blocks:
        y1 = x1 + f(x2, **kwargs)
        y2 = x2 + g(y1, **kwargs)
        x1, x2 = y1, y2
    return (y1 + y2) / 2

Each block is invertible given its outputs (``x2 = y2 - g(y1)``, then
``x1 = y1 - f(x2)``), so the backward pass rebuilds every block's inputs from the
final outputs instead of keeping them: activation memory does not grow with depth.
Cached (one token at a time) decoding calls ``f`` and ``g`` directly with the very
same rule, so the rule is part of the interface and is kept explicit above and in
``ReversibleSequence._compose``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["SequentialSequence", "ReversibleSequence"]


# --------------------------------------------------------------------------- blocks


def _build_blocks(blocks: Any) -> nn.ModuleList:
    """Validate ``blocks`` and wrap them as ``ModuleList[ModuleList([f, g])]``."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            "blocks must be a sequence of (f, g) pairs of nn.Module, got a single "
            f"{type(blocks).__name__}"
        )
    if not isinstance(blocks, Iterable):
        raise TypeError(f"blocks must be a sequence of (f, g) pairs, got {type(blocks).__name__}")
    pairs = []
    for i, pair in enumerate(blocks):
        if isinstance(pair, nn.Module) and not isinstance(pair, nn.ModuleList):
            raise TypeError(f"blocks[{i}] must be an (f, g) pair, got a single {type(pair).__name__}")
        try:
            pair = list(pair)
        except TypeError:
            raise TypeError(f"blocks[{i}] must be an (f, g) pair, got {type(pair).__name__}") from None
        if len(pair) != 2:
            raise ValueError(f"blocks[{i}] must hold exactly two modules (f, g), got {len(pair)}")
        for name, module in zip("fg", pair):
            if not isinstance(module, nn.Module):
                raise TypeError(f"blocks[{i}].{name} must be an nn.Module, got {type(module).__name__}")
        pairs.append(nn.ModuleList(pair))
    return nn.ModuleList(pairs)


def _check_input(x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")


class SequentialSequence(nn.Module):
    """Plain residual composition of ``(f, g)`` blocks, the reference the reversible one must equal.

    Args:
        blocks: sequence of ``(f, g)`` pairs of ``nn.Module``. ``f(x, **kwargs)`` and
            ``g(x, **kwargs)`` take ``x`` of shape ``(batch, seq, dim)`` (any shape
            works) and return a tensor of the same shape.
        checkpoint: gradient checkpointing: when gradients are needed, each block keeps
            only its input and is run again in backward (``torch.utils.checkpoint``,
            non-reentrant, RNG state preserved); the gradients are those without it.

    Attributes:
        blocks: ``nn.ModuleList`` of ``nn.ModuleList([f, g])``.

    Forward:
        x: ``(batch, seq, dim)``.
        **kwargs: passed unchanged to every ``f`` and ``g`` call (e.g. ``mask``,
            ``context``).

        Returns ``(batch, seq, dim)``: for each block, ``x = x + f(x); x = x + g(x)``.
    """

    def __init__(self, blocks, checkpoint=False):
        super().__init__()
        if not isinstance(checkpoint, bool):
            raise TypeError(f"checkpoint must be True or False, got {checkpoint!r}")
        self.blocks = _build_blocks(blocks)
        self.checkpoint = checkpoint

    @staticmethod
    def _block(f, g, x, **kwargs):
        x = x + f(x, **kwargs)
        return x + g(x, **kwargs)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        _check_input(x)
        for f, g in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                # keep only the block's input; backward runs the block again under the same
                # RNG state (dropout masks replay) and autocast state
                x = torch.utils.checkpoint.checkpoint(
                    self._block, f, g, x, use_reentrant=False, preserve_rng_state=True, **kwargs
                )
            else:
                x = self._block(f, g, x, **kwargs)
        return x


def _sharded_inside(blocks: nn.Module) -> bool:
    """Whether FSDP (``fully_shard`` or the wrapper class) wraps a module inside ``blocks``."""
    if not torch.distributed.is_available():
        return False
    import torch.distributed.fsdp as fsdp

    kinds = tuple(getattr(fsdp, name) for name in ("FSDPModule", "FullyShardedDataParallel") if hasattr(fsdp, name))
    return any(isinstance(m, kinds) for m in blocks.modules())


# --------------------------------------------------------------------------- replay state


def _device_module(device_type: str):
    getter = getattr(torch, "get_device_module", None)
    if getter is not None:
        return getter(device_type)
    return getattr(torch, device_type)  # pragma: no cover - torch < 2.3


def _rng_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The non-CPU devices (with their own generators) that ``tensors`` live on."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            seen.setdefault(t.device, None)
    return list(seen)


class _RngState:
    """The CPU generator state and those of ``devices``, taken at construction.

    ``replay()`` is a context that forks the generators (so the caller's streams are
    left untouched), installs the recorded states and so repeats the random draws
    (dropout masks) that the recorded call made.
    """

    __slots__ = ("cpu", "devices")

    def __init__(self, devices: list[torch.device]):
        self.cpu = torch.get_rng_state()
        self.devices = [(d, _device_module(d.type).get_rng_state(d)) for d in devices]

    @contextlib.contextmanager
    def replay(self):
        with contextlib.ExitStack() as stack:
            by_type: dict[str, list[torch.device]] = {}
            for d, _ in self.devices:
                by_type.setdefault(d.type, []).append(d)
            if not by_type:
                stack.enter_context(torch.random.fork_rng(devices=[]))
            for device_type, devices in by_type.items():
                # each fork also forks (and restores) the CPU generator
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
            torch.set_rng_state(self.cpu)
            for d, state in self.devices:
                _device_module(d.type).set_rng_state(state, d)
            yield


def _autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)
    return check(device_type) if check is not None else device_type in ("cpu", "cuda")


def _capture_autocast(device_types: Iterable[str]) -> list[tuple[str, bool, torch.dtype]]:
    """``(device_type, enabled, dtype)`` of the current autocast state per device type."""
    state = []
    for device_type in dict.fromkeys(device_types):
        if _autocast_available(device_type):
            state.append(
                (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            )
    return state


@contextlib.contextmanager
def _restore_autocast(state: list[tuple[str, bool, torch.dtype]], cache_enabled: bool):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(
                torch.autocast(
                    device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
                )
            )
        yield


def _nested_grad_tensor(value: Any) -> bool:
    """True if a list/tuple/dict ``value`` hides a tensor that requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_nested_grad_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_nested_grad_tensor(v) for v in value.values())
    return False


# --------------------------------------------------------------------------- reversible autograd


class _ReversibleFunction(torch.autograd.Function):
    """Runs the reversible stack without storing block activations.

    ``apply(blocks, spec, x, *kwarg_tensors, *params)`` returns ``(y1, y2)``, the two
    streams after the last block.

    * ``spec`` holds the names of the tensor kwargs (their values come as the
      explicit inputs ``kwarg_tensors``, so autograd can route gradients to, say, an
      encoder ``context``) and the non-tensor kwargs, passed through as they are.
    * ``params`` are the distinct parameters of the blocks that require grad. They
      are explicit inputs so that autograd, not this function, owns their
      accumulation: ``backward`` computes them with ``torch.autograd.grad`` (which
      never touches ``.grad`` or fires accumulate-grad hooks) and returns them summed
      over every use, so each parameter is accumulated exactly once per backward.
      That is what DDP needs (no "marked ready twice"), and a module shared between
      blocks gets the sum of its uses.

    Saved for backward: only ``y1``, ``y2`` and the tensor kwargs, whatever the depth.
    """

    @staticmethod
    def forward(ctx, blocks, spec, x, *tensors):
        names, static_kwargs = spec
        kwarg_tensors = tensors[: len(names)]
        params = tensors[len(names) :]
        kwargs = dict(static_kwargs, **dict(zip(names, kwarg_tensors)))

        devices = _rng_devices((x, *kwarg_tensors))
        ctx.autocast = _capture_autocast(["cpu", x.device.type, *(d.type for d in devices)])
        ctx.autocast_cache = torch.is_autocast_cache_enabled()

        states = []
        x1 = x2 = x
        for f, g in blocks:
            f_state = _RngState(devices)
            y1 = x1 + f(x2, **kwargs)
            g_state = _RngState(devices)
            y2 = x2 + g(y1, **kwargs)
            states.append((f_state, g_state))
            x1, x2 = y1, y2

        ctx.blocks = blocks
        ctx.names = names
        ctx.static_kwargs = static_kwargs
        ctx.rng_states = states
        ctx.params = params
        ctx.param_versions = [p._version for p in params]
        ctx.save_for_backward(x1, x2, *kwarg_tensors)
        return x1, x2

    @staticmethod
    @once_differentiable
    def backward(ctx, dy1, dy2):
        y1, y2, *kwarg_tensors = ctx.saved_tensors
        params = ctx.params
        for p, version in zip(params, ctx.param_versions):
            if p._version != version:
                raise RuntimeError(
                    "a parameter of a ReversibleSequence was modified in place between the "
                    "forward and the backward pass; the blocks cannot be recomputed"
                )
        registered = {id(p) for p in ctx.blocks.parameters()}
        if any(id(p) not in registered for p in params):
            raise RuntimeError(
                "the parameters of a ReversibleSequence were replaced between the forward "
                "and the backward pass (e.g. by torch.func.functional_call); the blocks "
                "cannot be recomputed with the parameters the forward used"
            )
        n_names = len(ctx.names)
        needs_kwarg_grad = ctx.needs_input_grad[3 : 3 + n_names]

        # detached leaves that collect the gradients of the tensor kwargs
        kwarg_leaves = [
            t.detach().requires_grad_(need) for t, need in zip(kwarg_tensors, needs_kwarg_grad)
        ]
        kwargs = dict(ctx.static_kwargs, **dict(zip(ctx.names, kwarg_leaves)))
        grad_kwarg_leaves = [t for t in kwarg_leaves if t.requires_grad]
        kwarg_grads: list[torch.Tensor | None] = [None] * len(grad_kwarg_leaves)

        param_index = {id(p): i for i, p in enumerate(params)}
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        module_params: dict[int, list[int]] = {}

        def params_of(module: nn.Module) -> list[int]:
            key = id(module)
            if key not in module_params:
                module_params[key] = [
                    param_index[id(p)] for p in module.parameters() if id(p) in param_index
                ]
            return module_params[key]

        def accumulate(store, i, grad):
            if grad is not None:
                store[i] = grad if store[i] is None else store[i] + grad

        def recompute(module, state, inp, grad_out):
            """Run ``module(inp)`` again as recorded; return its output (detached) and
            the gradient of ``<module(inp), grad_out>`` w.r.t. ``inp`` (None if zero),
            accumulating those of the kwargs and parameters."""
            leaf = inp.detach().requires_grad_(True)
            with torch.enable_grad(), state.replay(), _restore_autocast(ctx.autocast, ctx.autocast_cache):
                out = module(leaf, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"a reversible block returned {type(out).__name__}, expected a tensor")
            if not out.requires_grad:  # a block that ignores its input and has no parameters
                return out.detach(), None
            indices = params_of(module)
            inputs = [leaf, *grad_kwarg_leaves, *(params[i] for i in indices)]
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            n_kw = len(grad_kwarg_leaves)
            for j, grad in enumerate(grads[1 : 1 + n_kw]):
                accumulate(kwarg_grads, j, grad)
            for i, grad in zip(indices, grads[1 + n_kw :]):
                accumulate(param_grads, i, grad)
            return out.detach(), grads[0]

        y1, y2 = y1.detach(), y2.detach()
        for (f, g), (f_state, g_state) in zip(reversed(ctx.blocks), reversed(ctx.rng_states)):
            # y2 = x2 + g(y1): undo it, and send dy2 through g into y1
            gy1, grad_y1 = recompute(g, g_state, y1, dy2)
            x2 = y2 - gy1
            if grad_y1 is not None:
                dy1 = dy1 + grad_y1
            del gy1, grad_y1
            # y1 = x1 + f(x2): undo it, and send dy1 through f into x2
            fx2, grad_x2 = recompute(f, f_state, x2, dy1)
            x1 = y1 - fx2
            dx2 = dy2 if grad_x2 is None else dy2 + grad_x2
            del fx2, grad_x2
            y1, y2, dy2 = x1, x2, dx2  # dx1 = dy1

        dx = dy1 + dy2 if ctx.needs_input_grad[2] else None
        kwarg_grads_iter = iter(kwarg_grads)
        kwarg_out = [
            next(kwarg_grads_iter) if leaf.requires_grad else None for leaf in kwarg_leaves
        ]
        return (None, None, dx, *kwarg_out, *param_grads)


class ReversibleSequence(nn.Module):
    """Reversible composition of ``(f, g)`` blocks whose activations are rebuilt in backward.

    Composition rule (also what cached decoding applies token by token, calling each
    ``f`` and ``g`` directly)::

        x1 = x2 = x
        for f, g in blocks:
            y1 = x1 + f(x2, **kwargs)
            y2 = x2 + g(y1, **kwargs)
            x1, x2 = y1, y2
        out = (y1 + y2) / 2

    When gradients are needed, the forward runs without autograd and keeps only the
    final ``y1``, ``y2`` (and the tensor kwargs); the backward inverts the blocks one
    at a time (``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``), recomputing ``f`` and ``g``
    under the recorded CPU/accelerator RNG states (dropout masks replay exactly) and
    autocast state. Activation memory is therefore that of a single block, whatever
    the depth. Under ``torch.no_grad`` / inference (or when nothing requires grad)
    the rule is evaluated directly.

    Gradient routing: the input, the top-level tensor kwargs and the (distinct)
    parameters of the blocks are all explicit inputs of one autograd Function. Its
    backward gets every gradient with ``torch.autograd.grad`` on the recomputed
    block outputs (no nested ``.backward()``), sums the contributions of every use,
    and returns them; autograd then accumulates each parameter's gradient exactly
    once per backward, as DDP's reducer expects, and shared modules get the sum of
    their uses.

    Requirements on the blocks: ``f`` and ``g`` must be deterministic given the RNG
    state (and the autocast state), use only parameters registered on themselves
    (or their submodules), and return a tensor shaped like their input. Side
    effects such as BatchNorm running-statistic updates happen again during the
    recomputation. Parameters must not be modified in place, nor replaced (as
    ``torch.func.functional_call`` does), between the forward and the backward: the
    recomputation reads the modules' current parameters, so either raises a
    RuntimeError rather than returning wrong gradients.

    Args:
        blocks: sequence of ``(f, g)`` pairs of ``nn.Module``; ``f(x, **kwargs)`` and
            ``g(x, **kwargs)`` take ``x`` of shape ``(batch, seq, dim)`` (any shape
            works) and return a tensor of the same shape. The same module may appear
            in several blocks (shared weights).

    Attributes:
        blocks: ``nn.ModuleList`` of ``nn.ModuleList([f, g])``.

    Forward:
        x: ``(batch, seq, dim)``.
        **kwargs: passed to every ``f`` and ``g`` call. Top-level tensors (e.g. an
            encoder ``context`` of shape ``(batch, ctx_seq, dim)``, a ``mask`` of shape
            ``(batch, seq)``) are routed through autograd and receive their gradients;
            ``None``, ints and other values pass through unchanged. A tensor that
            requires grad nested inside a list/tuple/dict kwarg raises ``TypeError``
            (its gradient could not be delivered).

        Returns ``(batch, seq, dim)``: ``(y1 + y2) / 2`` after the last block (``x``
        itself when there are no blocks).
    """

    def __init__(self, blocks):
        super().__init__()
        self.blocks = _build_blocks(blocks)

    def _compose(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The composition rule evaluated directly (used when no gradient is needed)."""
        x1 = x2 = x
        for f, g in self.blocks:
            y1 = x1 + f(x2, **kwargs)
            y2 = x2 + g(y1, **kwargs)
            x1, x2 = y1, y2
        return (x1 + x2) / 2

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        _check_input(x)
        if len(self.blocks) == 0:
            return x

        names, kwarg_tensors, static_kwargs = [], [], {}
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                names.append(name)
                kwarg_tensors.append(value)
            else:
                static_kwargs[name] = value

        if not torch.is_grad_enabled():
            return self._compose(x, **kwargs)

        for name, value in static_kwargs.items():
            if _nested_grad_tensor(value):
                raise TypeError(
                    f"kwarg {name!r} nests a tensor that requires grad inside a container; "
                    "pass such tensors as top-level keyword arguments"
                )
        params = [p for p in self.parameters() if p.requires_grad]
        if not (x.requires_grad or params or any(t.requires_grad for t in kwarg_tensors)):
            return self._compose(x, **kwargs)

        if _sharded_inside(self.blocks):
            raise TypeError(
                "a ReversibleSequence cannot hold FSDP units: its backward recomputes the blocks "
                "outside FSDP's hooks, so their gradients would be lost; apply fully_shard to the "
                "reversible stack (or a module around it) as one unit"
            )
        spec = (tuple(names), static_kwargs)
        y1, y2 = _ReversibleFunction.apply(self.blocks, spec, x, *kwarg_tensors, *params)
        return (y1 + y2) / 2
