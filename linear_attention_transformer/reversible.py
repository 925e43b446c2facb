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

Each block is invertible given its outputs (``x2 = y2 - g(y1)``, then ``x1 = y1 -
f(x2)``), so backward rebuilds every block's inputs from the final outputs: activation
memory does not grow with depth. Cached decoding applies the same rule token by token.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["SequentialSequence", "ReversibleSequence"]


def _build_blocks(blocks: Any) -> nn.ModuleList:
    """Validate ``blocks`` and wrap them as ``ModuleList[ModuleList([f, g])]``."""
    def sequence(value):  # (a single module is not, though some modules are iterable)
        return isinstance(value, nn.ModuleList) or (isinstance(value, Iterable) and not isinstance(value, nn.Module))

    if not sequence(blocks):
        raise TypeError(f"blocks must be a sequence of (f, g) pairs of nn.Module, got {type(blocks).__name__}")
    pairs = []
    for i, pair in enumerate(blocks):
        if not sequence(pair):
            raise TypeError(f"blocks[{i}] must be an (f, g) pair, got {type(pair).__name__}")
        pair = list(pair)
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


def plain_rule(x, pairs):
    """x <- x + f(x), x <- x + g(x) for each (f, g) of one-argument callables."""
    for f, g in pairs:
        x = x + f(x)
        x = x + g(x)
    return x


class SequentialSequence(nn.Module):
    """Plain residual composition of ``(f, g)`` blocks (the module docstring's first rule).

    Args:
        blocks: sequence of ``(f, g)`` pairs of ``nn.Module`` (see the module docstring).
        checkpoint: when gradients are needed, each block keeps only its input and runs again
            in backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved).
    Forward: x (batch, seq, dim); ``**kwargs`` go to every ``f`` and ``g``. Returns x's shape.
    """

    def __init__(self, blocks, checkpoint=False):
        super().__init__()
        if not isinstance(checkpoint, bool):
            raise TypeError(f"checkpoint must be True or False, got {checkpoint!r}")
        self.blocks = _build_blocks(blocks)
        self.checkpoint = checkpoint

    compose = staticmethod(plain_rule)  # (cached decoding's composition too)

    @staticmethod
    def _block(f, g, x, **kwargs):
        return plain_rule(x, _bound([(f, g)], kwargs))

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        _check_input(x)
        for f, g in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(self._block, f, g, x, use_reentrant=False,
                                                      preserve_rng_state=True, **kwargs)
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


def _device_module(device_type: str):
    getter = getattr(torch, "get_device_module", None)  # (torch < 2.3: torch.<device_type>)
    return getter(device_type) if getter is not None else getattr(torch, device_type)


def _rng_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The non-CPU devices (with their own generators) that ``tensors`` live on."""
    return list(dict.fromkeys(t.device for t in tensors if t.device.type not in ("cpu", "meta")))


class _RngState:
    """The CPU generator state and those of ``devices``, taken at construction; ``replay()``
    forks the generators (the caller's streams stay untouched) and installs them, so the
    recorded call's random draws (dropout masks) repeat."""

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


def _capture_autocast(device_types: Iterable[str]) -> list[tuple[str, bool, torch.dtype]]:
    available = getattr(torch.amp, "is_autocast_available", lambda device_type: device_type in ("cpu", "cuda"))
    return [(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            for device_type in dict.fromkeys(device_types) if available(device_type)]


@contextlib.contextmanager
def _restore_autocast(state: list[tuple[str, bool, torch.dtype]], cache_enabled: bool):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache_enabled))
        yield


def _nested_grad_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_nested_grad_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_nested_grad_tensor(v) for v in value.values())
    return False


class _ReversibleFunction(torch.autograd.Function):
    """``apply(blocks, spec, x, *kwarg_tensors, *params)`` -> (y1, y2), the two streams after the
    last block, saving only them and the tensor kwargs. ``spec``: the tensor kwargs' names
    (their values are inputs, so autograd routes their gradients) and the other kwargs.
    ``params``: the blocks' distinct parameters that require grad, as inputs, so that autograd
    accumulates each exactly once per backward (what DDP needs; a shared module gets the sum
    of its uses): backward computes them with ``torch.autograd.grad``."""

    @staticmethod
    def forward(ctx, blocks, spec, x, *tensors):
        names, static_kwargs = spec
        kwarg_tensors = tensors[: len(names)]
        params = tensors[len(names) :]
        kwargs = dict(static_kwargs, **dict(zip(names, kwarg_tensors)))

        devices = _rng_devices((x, *kwarg_tensors))
        ctx.autocast = _capture_autocast(["cpu", x.device.type, *(d.type for d in devices)])
        ctx.autocast_cache = torch.is_autocast_cache_enabled()

        ctx.rng_states = []
        x1, x2 = reversible_rule(x, _bound(blocks, kwargs), lambda: ctx.rng_states.append(_RngState(devices)))
        ctx.blocks, ctx.names, ctx.static_kwargs, ctx.params = blocks, names, static_kwargs, params
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
                raise RuntimeError("a parameter of a ReversibleSequence was modified in place between the forward and "
                                   "the backward pass; the blocks cannot be recomputed")
        registered = {id(p) for p in ctx.blocks.parameters()}
        if any(id(p) not in registered for p in params):
            raise RuntimeError("the parameters of a ReversibleSequence were replaced between the forward and the "
                               "backward pass (e.g. by torch.func.functional_call); the blocks cannot be recomputed "
                               "with the parameters the forward used")
        # detached leaves that collect the gradients of the tensor kwargs
        needs_kwarg_grad = ctx.needs_input_grad[3 : 3 + len(ctx.names)]
        kwarg_leaves = [t.detach().requires_grad_(need) for t, need in zip(kwarg_tensors, needs_kwarg_grad)]
        kwargs = dict(ctx.static_kwargs, **dict(zip(ctx.names, kwarg_leaves)))
        grad_kwargs = [i for i, t in enumerate(kwarg_leaves) if t.requires_grad]
        kwarg_grads: list[torch.Tensor | None] = [None] * len(kwarg_leaves)

        param_index = {id(p): i for i, p in enumerate(params)}
        param_grads: list[torch.Tensor | None] = [None] * len(params)

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
            indices = [param_index[id(p)] for p in module.parameters() if id(p) in param_index]
            inputs = [leaf, *(kwarg_leaves[j] for j in grad_kwargs), *(params[i] for i in indices)]
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            n_kw = len(grad_kwargs)
            for j, grad in zip(grad_kwargs, grads[1 : 1 + n_kw]):
                accumulate(kwarg_grads, j, grad)
            for i, grad in zip(indices, grads[1 + n_kw :]):
                accumulate(param_grads, i, grad)
            return out.detach(), grads[0]

        y1, y2 = y1.detach(), y2.detach()
        rng_states = list(zip(ctx.rng_states[0::2], ctx.rng_states[1::2]))
        for (f, g), (f_state, g_state) in zip(reversed(ctx.blocks), reversed(rng_states)):
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
        return (None, None, dx, *kwarg_grads, *param_grads)


class ReversibleSequence(nn.Module):
    """Reversible composition of ``(f, g)`` blocks (the module docstring's second rule): the
    forward keeps only the final y1, y2 and the tensor kwargs, and backward recomputes ``f``
    and ``g`` under the recorded RNG (dropout masks replay) and autocast states.

    The blocks must be deterministic given the RNG and autocast states and use only their own
    (registered) parameters; side effects (BatchNorm statistics) happen again when
    recomputed. Parameters modified in place or replaced (``torch.func.functional_call``)
    between forward and backward raise a RuntimeError rather than give wrong gradients.

    Args:
        blocks: as ``SequentialSequence``'s; a module may appear in several (shared weights).
    Forward: x (batch, seq, dim); ``**kwargs`` go to every ``f`` and ``g``: top-level tensors
    (a ``context``, a ``mask``) get their gradients, other values pass unchanged, and a tensor
    that requires grad nested in a container raises TypeError. Returns ``(y1 + y2) / 2`` (x
    itself without blocks).
    """

    def __init__(self, blocks):
        super().__init__()
        self.blocks = _build_blocks(blocks)

    @staticmethod
    def compose(x, pairs):
        """The reversible rule's output over ``pairs`` of one-argument callables (no memory
        saving: cached decoding's form)."""
        y1, y2 = reversible_rule(x, pairs)
        return (y1 + y2) / 2

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        _check_input(x)
        if len(self.blocks) == 0:
            return x
        names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
        kwarg_tensors = [kwargs[name] for name in names]
        static_kwargs = {name: value for name, value in kwargs.items() if name not in names}
        params = [p for p in self.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        if torch.is_grad_enabled():
            for name, value in static_kwargs.items():
                if _nested_grad_tensor(value):
                    raise TypeError(f"kwarg {name!r} nests a tensor that requires grad inside a container; pass "
                                    "such tensors as top-level keyword arguments")
        grads = torch.is_grad_enabled() and (x.requires_grad or params or any(t.requires_grad for t in kwarg_tensors))
        if not grads:
            return self.compose(x, _bound(self.blocks, kwargs))
        if _sharded_inside(self.blocks):
            raise TypeError("a ReversibleSequence cannot hold FSDP units: its backward recomputes the blocks outside "
                            "FSDP's hooks, so their gradients would be lost; apply fully_shard to the reversible stack "
                            "(or a module around it) as one unit")
        y1, y2 = _ReversibleFunction.apply(self.blocks, (tuple(names), static_kwargs), x, *kwarg_tensors, *params)
        return (y1 + y2) / 2


def reversible_rule(x, pairs, before_call=None):
    """The reversible rule from x1 = x2 = x: y1 = x1 + f(x2), y2 = x2 + g(y1) for each (f, g)
    of one-argument callables; -> (y1, y2) after the last. ``before_call`` runs before each
    call of ``f`` and of ``g`` (the forward records the RNG states there)."""
    x1 = x2 = x
    for f, g in pairs:
        if before_call is not None:
            before_call()
        y1 = x1 + f(x2)
        if before_call is not None:
            before_call()
        x1, x2 = y1, x2 + g(y1)
    return x1, x2


def _bound(blocks, kwargs):
    return [(functools.partial(f, **kwargs), functools.partial(g, **kwargs)) for f, g in blocks]
