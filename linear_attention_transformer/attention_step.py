"""One token through an attention layer, on its cache's buffers, in place.

``Attention``'s cached path runs this for a single real token (no mask, no gradient), and
``Decoder`` at every step. The math lives with the pieces (``ops/windowed_attention.py``,
``ops/causal/recurrent.py``, ``gating.py``); here is the layer's composition, made fast: one
matmul projects the token to every head's q, k, v and the gates' inputs (weights concatenated
once when the step is made: parameters changed afterwards are not seen), the local heads'
keys go to a ring (``_Ring``), and eager steps, which know the position as an int
(``StepContext``), write through views and into buffers made once. Neither form reads back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import NO_KEY
from .gating import local_conv_step
from .ops.windowed_attention import windowed_attention_step
from .positional import apply_rotary

NEG_INF = float("-inf")


class StepContext:
    """What one step's layers share: the position p (a long tensor of no dimension), the same
    as an int on eager steps (else None), and the rotary (cos, sin) of the position or None.
    Under autocast a step takes the form a compiled step traces (its F.linear casts; the eager
    form writes into buffers of the model's dtype): ``host_position`` is then None."""

    __slots__ = ("position", "host_position", "rotary")

    def __init__(self, position, host_position, rotary):
        if host_position is not None and torch.is_autocast_enabled(position.device.type):
            host_position = None
        self.position, self.host_position, self.rotary = position, host_position, rotary


class AttentionStep:
    """One token through an ``Attention`` layer (causal self-attention) on its ``AttentionCache``.

    ``first_real``: the latest first real token over the rows (prompts padded on the left),
    when known: from the block after it every query of the global heads sees a key, and the
    guards for a row without one are left out (``read_state``'s ``all_seen``). ``steady``:
    prepare the local heads' table of biases (reads the ring once: a sync)."""

    def __init__(self, attn, cache, batch, first_real=None, steady=False):
        heads, dh, kvh = attn.heads, attn.dim_head, attn.kv_heads
        self.heads, self.dim_head, self.kv_heads = heads, dh, kvh
        self.n_local, self.n_global = nl, ng = attn.n_local, heads - attn.n_local
        gate, out_gate = attn.forget_gate, attn.output_gate
        linears = [attn.to_q, attn.to_kv] + ([] if gate is None else [gate.gate_down])
        linears += [] if out_gate is None else [out_gate.gate_out]
        sizes = [linear.out_features for linear in linears]
        self.weight = torch.cat([linear.weight for linear in linears], dim=0)
        # the local heads' queries come out of the projection already scaled by dim_head^-1/2
        # (rotary is a rotation: it commutes with the scale)
        self.weight[: nl * dh] *= dh ** -0.5
        self.bias = None
        if out_gate is not None:  # only the output gate has a bias: the others add exact zeros
            self.bias = torch.cat((self.weight.new_zeros(sum(sizes[:-1])), out_gate.gate_out.bias))
        self.ends = torch.tensor(sizes).cumsum(0).tolist()
        self.to_out, self.gate, self.out_gate = attn.to_out, gate, out_gate
        self.ring = self.state = self.conv = None
        if nl:
            self.ring = _Ring(attn.local_window, cache.local, cache.position if steady else None)
        if ng:
            global_ = cache.global_
            self.state, self.blindspot = global_.state, attn.blindspot_size
            self.feature_map, self.exp_features = attn.feature_map, attn.feature_map.is_softmax
            dtype = self.state.kv.dtype
            self.zero = torch.zeros((), dtype=dtype, device=self.state.kv.device)
            self.hidden = torch.full_like(self.zero, NEG_INF)
            self.seen_from = None
            if first_real is not None:  # the block after each row's first real token
                self.seen_from = first_real if self.blindspot == 1 else (first_real // self.blindspot + 1) * self.blindspot
            if attn.local_conv is not None:  # the three convolutions (q, k, v) as one: (3, heads, taps, dh)
                self.conv_taps = torch.stack([c.taps(ng) for c in attn.local_conv])
                self.conv = global_.conv
        self._eager_buffers(attn, batch)

    def _eager_buffers(self, attn, batch):
        """What eager steps write into and read through, made once: the projection's output
        and views of its parts, and the heads' outputs (b, heads * dh + 1) with a last column
        of ones, so that the output projection's bias is one more weight column."""
        b, heads, dh, nl = batch, self.heads, self.dim_head, self.n_local
        self.weight_t = self.weight.t()
        self.proj = proj = self.weight.new_empty(b, self.weight.shape[0])
        self.parts = None
        if attn.kv_heads == heads:  # the parts are views of the projection (before rotary): made once
            self.parts = self._split(proj, None)
        self.heads_out = proj.new_ones(b, heads * dh + 1)
        self.heads_flat = self.heads_out[:, :-1]
        heads_view = self.heads_flat.view(b, heads, dh)
        self.out_local, self.out_global = heads_view[:, :nl], heads_view[:, nl:]
        self.out_buffers = [t for t, n in ((self.out_local, nl), (self.out_global, heads - nl)) if n]
        self.out_weight_t = torch.cat((self.to_out.weight, self.to_out.bias[:, None]), dim=1).t()

    def buffers(self):
        """The cache's buffers this step updates in place."""
        found = [] if self.ring is None else [self.ring.cache.kv, self.ring.cache.positions]
        found += [] if self.conv is None else [self.conv]
        return found + ([] if self.state is None else self.state.buffers())

    def _split(self, proj, rotary):
        """The projection (b, width) -> (q local (b, nl, 1, dh), kv local (b, 2, nl, dh), q, k,
        v global (b, ng, dh) each): views, unless rotary or kv_heads make new tensors."""
        if rotary is None and proj is self.proj and self.parts is not None:
            return self.parts
        b, heads, dh, kvh, nl = proj.shape[0], self.heads, self.dim_head, self.kv_heads, self.n_local
        q_end, kv_end = self.ends[0], self.ends[1]
        if rotary is not None:  # q and k are side by side: rotate them at once
            qk = apply_rotary(proj[:, : q_end + kvh * dh].view(b, heads + kvh, dh), rotary)
            q = qk[:, :heads]
            kv = torch.stack((qk[:, heads:], proj[:, q_end + kvh * dh : kv_end].view(b, kvh, dh)), dim=1)
        else:
            q = proj[:, :q_end].view(b, heads, dh)
            kv = proj[:, q_end:kv_end].view(b, 2, kvh, dh)
        if kvh != heads:
            kv = kv.repeat_interleave(heads // kvh, dim=2)
        return q[:, :nl, None], kv[:, :, :nl], q[:, nl:], kv[:, 0, nl:], kv[:, 1, nl:]

    def __call__(self, h, ctx, into=None):
        """The branch's output for h (b, dim); with ``into`` (eager steps) added to it in
        place. A compiled step (``ctx.host_position`` None) makes new tensors: no buffer but
        the cache's is written."""
        eager = ctx.host_position is not None
        if eager:
            proj = self.proj
            if self.bias is None:
                torch.mm(h, self.weight_t, out=proj)
            else:
                torch.addmm(self.bias, h, self.weight_t, out=proj)
        else:
            proj = F.linear(h, self.weight, self.bias)
        q_local, kv_local, q, k, v = self._split(proj, ctx.rotary)
        outs = []
        if self.n_local:  # (q_local came out of the projection scaled)
            keys, values, bias = self.ring.step(kv_local, ctx)
            outs.append(windowed_attention_step(q_local, keys, values, bias, self.out_local if eager else None))
        if self.n_global:
            log_gate = None if self.gate is None else self.gate.log_gates(proj[:, self.ends[1] : self.ends[2]])
            outs.append(self._global(q, k, v, log_gate, ctx, self.out_global if eager else None))
        if not eager:
            out = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).flatten(1)
            if self.out_gate is not None:
                out = out * torch.sigmoid(proj[:, self.ends[-2]:])
            return F.linear(out, self.to_out.weight, self.to_out.bias)
        for out, buffer in zip(outs, self.out_buffers):
            if out is not buffer:
                buffer.copy_(out)
        if self.out_gate is not None:
            self.heads_flat.mul_(torch.sigmoid(proj[:, self.ends[-2]:]))
        if into is None:
            return torch.mm(self.heads_out, self.out_weight_t)
        return into.addmm_(self.heads_out, self.out_weight_t)

    def _global(self, q, k, v, log_gate, ctx, out=None):
        """The global heads' output (b, ng, dh), written into ``out`` when given and of the
        state's dtype."""
        if self.conv is not None:
            q, k, v = local_conv_step(torch.stack((q, k, v), dim=1), self.conv, self.conv_taps).unbind(1)
        if not self.exp_features:
            q, k = self.feature_map._pointwise(q), self.feature_map._pointwise(k)
        dtype = out_dtype = q.dtype
        if dtype != self.zero.dtype:
            dtype, out = self.zero.dtype, None
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            log_gate = None if log_gate is None else log_gate.to(dtype)
        host = ctx.host_position
        seen = host is not None and self.seen_from is not None and host >= self.seen_from
        where = self.state.where(ctx.position if host is None else host, self.blindspot, self.zero, self.hidden)
        out = self.state.step(q, k, v, log_gate, where, seen, out=out)
        return out if out.dtype == out_dtype else out.to(out_dtype)


class _Ring:
    """A step's bookkeeping of a ``LocalCache`` ring: entering position p writes p into its slot
    and gives the bias (b or 1, 1, slots), 0 on the slots from the query's first key on, -inf
    elsewhere. With ``steady_after`` (the position the ring continues from), once every slot
    holds a real key the bias is a row of a table made once, and eager steps leave the key
    positions to ``settle`` (one write fewer per step; the decoder settles when its cache is read)."""

    def __init__(self, window, cache, steady_after=None):
        self.window, self.cache = window, cache
        self.slots = slots = cache.slots
        kv, positions = cache.kv, cache.positions
        device = kv.device
        self.zero = torch.zeros((), dtype=kv.dtype, device=device)
        self.hidden = torch.full_like(self.zero, NEG_INF)
        # eager steps' views: each slot's (b, 2, h, dh), each slot's column of positions, keys
        # and values (b, h, slots, dh)
        self.kv_slots, self.position_slots = kv.unbind(3), positions.unbind(1)
        self.keys, self.values = kv.unbind(1)
        self.steady_from = self.steady = None
        self.settled = True  # whether cache.positions is up to date
        if steady_after is not None:  # the ring continues from position ``steady_after``
            # steady from the position after the next write of each slot without a real key (a sync, once)
            at = steady_after
            empty = (positions == NO_KEY).any(dim=0).nonzero().flatten().tolist()
            self.steady_from = max([at] + [at + (s - at) % slots + 1 for s in empty])
            self.steady = torch.tensor(self.steady_from, device=device)
            q = slots + torch.arange(slots, device=device)[:, None]  # one query per residue mod slots
            slot_positions = q - (q - torch.arange(slots, device=device)) % slots
            self.table = torch.where(window.visible(q, slot_positions), self.zero, self.hidden)[:, None, None]
            self.table_rows = self.table.unbind(0)

    def step(self, kv, ctx):
        """Enter position p with its key and value kv (b, 2, h, dh): (keys, values (b, h,
        slots, dh), bias)."""
        p, host = ctx.position, ctx.host_position
        cache = self.cache
        if host is not None:  # eager: the slot, and from steady on the bias, from the host
            slot = host % self.slots
            self.kv_slots[slot].copy_(kv)
            keys, values = self.keys, self.values
            if self.steady_from is not None and host >= self.steady_from:
                self.settled = False
                return keys, values, self.table_rows[slot]
            self.position_slots[slot].copy_(p)
            first = self.window.first_key(host)
        else:  # (views of the buffer made here: a compiled step's inputs do not alias)
            slot = torch.remainder(p, self.slots)[None]
            cache.kv.index_copy_(3, slot, kv[:, :, :, None].to(cache.kv.dtype))  # (autocast: kv in half)
            cache.positions.index_copy_(1, slot, p.expand(cache.positions.shape[0], 1))
            keys, values = cache.kv.unbind(1)
            first = self.window.first_key(p)
        bias = torch.where(cache.positions >= first, self.zero, self.hidden)[:, None]
        if host is None and self.steady is not None:  # (not the int: a compiled step would guard on it)
            bias = torch.where(p >= self.steady, self.table.index_select(0, slot)[0], bias)
        return keys, values, bias

    def settle(self, position):
        """Write the key positions that steady eager steps left out, ``position`` tokens in:
        every slot then holds a real key, slot s the latest position congruent to s."""
        if not self.settled:
            last = position - 1
            slots = torch.arange(self.slots, device=self.cache.positions.device)
            self.cache.positions.copy_((last - (last - slots) % self.slots).expand_as(self.cache.positions))
            self.settled = True
