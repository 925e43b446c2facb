"""Many sequences at once, each continuing from its own slot of a pool of decoding states.

A serving engine keeps one state per request in a pool of fixed slots and, at each call, hands
the model a flat batch of new tokens: some requests are prefilling (several tokens, possibly one
chunk of a longer prompt), others decoding (one token), each at its own position. A slot holds
exactly what a one-row ``DecodingCache`` holds, less the position, which the engine gives with
each call: the global heads' state, the local heads' ring, the convolution's and the token
shift's last inputs (``slot_layout``).

``continue_in_slots`` runs such a batch through the model's own forward, so every token
gets what it would get from its sequence run alone:

* the decoding requests go through one cached step together. The cache counts one position
  for all rows, so a row at position p of a step at column P = max(p) starts at P - p, as a
  row padded on the left does (``place.py``); a row's state does not depend on the column its
  sequence started at (a ring holds the key of position t in slot t mod slots). A model with
  blindspot blocks steps each request alone (its blocks follow the column);
* each prefilling request runs alone, through the chunked forms, from its slot.

A request at position 0 starts from the empty state, whatever its slot holds (an engine
reuses slots without clearing them).
"""

from __future__ import annotations

import torch

from .cache import map_tensors, tensors_of


def slot_layout(model):
    """What one slot holds for ``model`` (a ``LinearAttentionTransformerLM``), block by block:
    a list with one entry per residual block, each a list of (shape, dtype) of its tensors, in
    the order ``continue_in_slots`` takes them."""
    _check_model(model)
    empty = model.empty_cache(1)
    return [[(tuple(t.shape[1:]), t.dtype) for t in tensors_of(pair)] for pair in empty.layers]


def empty_pool(model, num_slots, device=None):
    """A pool of ``num_slots`` slots, each at the empty state: one list of tensors (num_slots,
    *shape) per block, as ``slot_layout`` lists them."""
    empty = model.empty_cache(num_slots, device=device)
    return [tensors_of(pair) for pair in empty.layers]


@torch.no_grad()
def continue_in_slots(model, pool, tokens, query_starts, slots, positions):
    """The output features for a batch of requests, each continuing its sequence from its slot
    of ``pool`` (updated in place).

    Args:
        model: a causal ``LinearAttentionTransformerLM`` in eval mode.
        pool: per block, the list of its state tensors (num_slots, *shape) (``empty_pool``, or an
            engine's buffers of ``slot_layout``'s shapes and dtypes).
        tokens: (T,) long, the requests' new tokens one after another.
        query_starts: (R + 1,) long, request r's tokens at query_starts[r] : query_starts[r + 1].
        slots: (R,) long, request r's slot.
        positions: (R,) long, the position of request r's first new token in its sequence (0:
            a new sequence, its slot read as empty).

    Returns (T, dim) float: the features the model's output layer reads (``model.logits_of``
    turns them into logits), each row what the request's sequence alone gives there.
    """
    _check_model(model)
    query_starts, slots, positions = (t.tolist() for t in (query_starts, slots, positions))
    if len(query_starts) != len(slots) + 1 or len(positions) != len(slots):
        raise ValueError(f"query_starts must have one entry more than slots and positions, got {len(query_starts)}, "
                         f"{len(slots)} and {len(positions)}")
    counts = [b - a for a, b in zip(query_starts, query_starts[1:])]
    if any(c < 1 for c in counts) or query_starts[0] != 0 or query_starts[-1] != tokens.shape[0]:
        raise ValueError("query_starts must rise from 0 to the number of tokens, at least one token per request")
    out = [None] * len(slots)
    decoding = [r for r, c in enumerate(counts) if c == 1]
    together = decoding if len(decoding) > 1 and model.transformer.blindspot_size == 1 else []
    if together:
        rows = torch.tensor([query_starts[r] for r in together], device=tokens.device)
        features = _run(model, pool, tokens[rows][:, None], [slots[r] for r in together],
                        [positions[r] for r in together])
        for i, r in enumerate(together):
            out[r] = features[i]
    for r in range(len(slots)):
        if out[r] is None:
            chunk = tokens[query_starts[r]:query_starts[r + 1]][None]
            out[r] = _run(model, pool, chunk, [slots[r]], [positions[r]])[0]
    return torch.cat(out, dim=0)


def _run(model, pool, x, slots, positions):
    """x (rows, n) continuing the sequences in ``slots`` at ``positions``: the features (rows,
    n, dim), the slots updated. Rows whose slots, sorted, are consecutive run on views of the
    pool, updated in place; others on copies of their slots, written back."""
    device = pool[0][0].device
    order = sorted(range(len(slots)), key=slots.__getitem__)
    first = slots[order[0]]
    in_place = all(slots[i] == first + r for r, i in enumerate(order))
    if in_place:  # (the rows in the order of their slots)
        x, positions = x[torch.tensor(order, device=x.device)], [positions[i] for i in order]
        taken = [t[first : first + len(slots)] for block in pool for t in block]
    else:
        index = torch.tensor(slots, device=device)
        taken = [t[index] for block in pool for t in block]
    template = model.empty_cache(1, device=device)  # (one row: the empty state, and the structure)
    fresh = [r for r, p in enumerate(positions) if p == 0]
    for empty, t in zip(tensors_of(template.layers), taken):
        for r in fresh:
            t[r].copy_(empty[0])
    taken = iter(taken)
    cache = template
    cache.layers = map_tensors(template.layers, lambda t: next(taken))
    column = max(positions)
    cache.position.fill_(column)
    if any(p != column for p in positions):
        cache.row_starts = torch.tensor([column - p for p in positions], device=device)
    out, cache = model.continue_features(x, cache)
    if in_place:
        return out[torch.tensor(order, device=out.device).argsort()]
    for block, part in zip(pool, cache.layers):
        for buffer, value in zip(block, tensors_of(part)):
            buffer.index_copy_(0, index, value.to(buffer.dtype))
    return out


def _check_model(model):
    from .lm import LinearAttentionTransformerLM  # (lm imports nothing from here)

    if not isinstance(model, LinearAttentionTransformerLM):
        raise TypeError(f"model must be a LinearAttentionTransformerLM, got {type(model).__name__}")
    if (why := model.transformer.cache_refusal) is not None:
        raise ValueError(why)
    if model.transformer.attend_axially:
        raise ValueError("attend_axially=True keeps a state per axial row, which a slot does not hold")
    if model.transformer.receives_context:
        raise ValueError("receives_context=True reads an encoder's context, which a slot does not hold")
    if model.return_embeddings:
        raise ValueError("return_embeddings=True gives no logits to serve")
