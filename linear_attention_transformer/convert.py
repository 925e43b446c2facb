"""Pretrained models into this library's: an exact import of a Llama-family checkpoint, and its
softmax heads turned into window + linear heads, trained to match them.

``from_llama(hf_model)`` reads a Hugging Face ``LlamaForCausalLM`` (any object with its config
and parameter names: transformers itself is not imported here) and returns the
``LinearAttentionTransformerLM`` that computes the same logits. Every head becomes a local
softmax head whose window is the checkpoint's ``max_position_embeddings`` (exact: each query sees
the last w keys), so up to that length the model is the checkpoint, and past it a sliding
window of that length. The Llama block maps onto the library's options:

    RMSNorm (rms_norm_eps)       norm="rmsnorm", norm_eps
    rotary positions (rope_theta)  use_rotary_emb=True, rotary_base
    grouped key/value heads       kv_heads
    SwiGLU MLP (intermediate)    ff_glu=True, ff_activation="silu", ff_hidden_dim
    no biases                    bias=False
    tied embeddings              tie_embedding

What has no exact counterpart here (rope scaling, biases on attention or MLP, a sliding window,
attention dropout, another activation or architecture) is refused by name.

``linearize(model, window)`` then makes each head see the last ``window`` keys by softmax and
every older key by linear attention through learnt features, one normalisation over both
(LoLCATs' form, ``heads.WindowLinearHeads``): a state of fixed size, whatever the length. It
keeps every pretrained weight; ``transfer_attention`` trains the new parameters alone so that
each layer's output matches the softmax layer's on the same input (attention transfer), and
``finetune`` then trains them with the attention projections on the next-token loss (LoLCATs'
two stages, the second on selected parameters rather than low-rank adapters).

``mix(model, n_local_attn_heads, window)`` makes of it this library's own mixed layer instead:
some heads of each layer keep their softmax window, the others become global linear heads
(additive or delta rule, gated or not), trained by the same two stages.
"""

from __future__ import annotations

import itertools
import os
import time

import torch
import torch.nn.functional as F

from .attention import Attention
from .lm import LinearAttentionTransformerLM
from .ops.common import check_int
from .place import PLAIN

LLAMA_TYPES = ("llama",)


def _rope(config):
    """(rope_type, rope_theta) of a config of transformers 5 (``rope_parameters``) or 4
    (``rope_theta``, ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params.get("rope_type", params.get("type", "default")), params.get("rope_theta", 10000.0)


def llama_options(config):
    """The ``LinearAttentionTransformerLM`` keywords of a Llama config; ValueError naming each
    setting that this library cannot reproduce exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_TYPES:
        raise ValueError(f"from_llama reads Llama checkpoints (model_type 'llama'), got model_type={model_type!r}")
    rope_type, rope_theta = _rope(config)
    refusals = [
        (rope_type != "default", f"rope scaling (rope_type={rope_type!r}): the library's rotary angles are unscaled"),
        (getattr(config, "attention_bias", False), "attention_bias=True: the library's q, k, v have no bias"),
        (getattr(config, "mlp_bias", False), "mlp_bias=True: the library's feed-forward has no bias without "
         "the attention output's"),
        (getattr(config, "sliding_window", None) is not None,
         f"sliding_window={getattr(config, 'sliding_window', None)}: the import's window is max_position_embeddings"),
        (getattr(config, "attention_dropout", 0.0), f"attention_dropout={getattr(config, 'attention_dropout', 0.0)}: "
         "the library's attn_dropout acts on the heads' outputs, not on the attention weights"),
        (getattr(config, "hidden_act", "silu") != "silu",
         f"hidden_act={getattr(config, 'hidden_act', None)!r}: the gated feed-forward here takes 'silu'"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"from_llama cannot import this checkpoint exactly: {why}")
    heads = config.num_attention_heads
    window = config.max_position_embeddings
    return dict(
        num_tokens=config.vocab_size, dim=config.hidden_size, depth=config.num_hidden_layers, max_seq_len=window,
        heads=heads, dim_head=getattr(config, "head_dim", None) or config.hidden_size // heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, causal=True, n_local_attn_heads=heads,
        local_attn_window_size=window, local_attn_exact_windowsize=True, use_rotary_emb=True,
        rotary_base=float(rope_theta), norm="rmsnorm", norm_eps=config.rms_norm_eps, bias=False, ff_glu=True,
        ff_activation="silu", ff_hidden_dim=config.intermediate_size,
        tie_embedding=bool(getattr(config, "tie_word_embeddings", False)),
    )


def from_llama(hf_model):
    """The ``LinearAttentionTransformerLM`` equal to ``hf_model`` (a ``LlamaForCausalLM``), on
    its device and in its dtype, in eval mode; its weights are copies (the two models share no
    tensor). Its logits equal the checkpoint's at every length up to ``max_position_embeddings``."""
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(hf_model, "state_dict"):
        raise TypeError(f"from_llama takes a Hugging Face LlamaForCausalLM, got {type(hf_model).__name__}")
    options = llama_options(config)
    source = hf_model.state_dict()
    if "model.embed_tokens.weight" not in source or ("lm_head.weight" not in source and not options["tie_embedding"]):
        raise ValueError("from_llama needs the model with its output layer (LlamaForCausalLM), got one without "
                         f"lm_head ({type(hf_model).__name__})")
    parameter = next(iter(source.values()))
    with torch.device("meta"):  # (no values drawn: every parameter comes from the checkpoint)
        model = LinearAttentionTransformerLM(**options)
    model.load_state_dict(_library_state(source, options["depth"], options["tie_embedding"]), strict=True, assign=True)
    if options["tie_embedding"]:
        model.to_logits.weight = model.token_emb.weight
    # the rotary frequencies are no weights: computed in float32, kept in float64 by a float64 model
    rotary = model.transformer.rotary
    rotary.inv_freq = rotary.inverse_frequencies(parameter.device).to(torch.promote_types(parameter.dtype,
                                                                                          torch.float32))
    return model.eval()


def _library_state(source, depth, tied):
    """The library's state dict from a Llama one: each layer's q, then k and v side by side, its
    MLP's up and gate rows side by side (the GLU's value, then its gate); copies."""
    def get(name):
        return source["model." + name].detach().clone()

    state = {"token_emb.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    if not tied:
        state["to_logits.weight"] = source["lm_head.weight"].detach().clone()
    for i in range(depth):
        layer, block = f"layers.{i}.", f"transformer.layers.blocks.{i}."
        state.update({
            block + "0.norm.weight": get(layer + "input_layernorm.weight"),
            block + "0.fn.to_q.weight": get(layer + "self_attn.q_proj.weight"),
            block + "0.fn.to_kv.weight": torch.cat((get(layer + "self_attn.k_proj.weight"),
                                                     get(layer + "self_attn.v_proj.weight"))),
            block + "0.fn.to_out.weight": get(layer + "self_attn.o_proj.weight"),
            block + "1.norm.weight": get(layer + "post_attention_layernorm.weight"),
            block + "1.fn.proj_in.weight": torch.cat((get(layer + "mlp.up_proj.weight"),
                                                       get(layer + "mlp.gate_proj.weight"))),
            block + "1.fn.proj_out.weight": get(layer + "mlp.down_proj.weight"),
        })
    if tied:  # (tied again once loaded)
        state["to_logits.weight"] = state["token_emb.weight"]
    return state


def linearize(model, window=64, sinks=4, feature_dim=None):
    """A copy of ``model`` whose heads see the last ``window`` keys and the first ``sinks`` by
    softmax and every other older key by linear attention through learnt features of
    ``feature_dim`` (default: the heads' width), under one normalisation
    (``local_attn_older_keys='linear'``). Every weight of ``model`` is kept; the features start
    at the identity (``heads.HedgehogFeatures``), untrained (``transfer_attention`` trains
    them). ``model``: causal, every head a local head with an exact window, as ``from_llama``
    returns it."""
    check_int("window", window)
    return _rebuilt(model, "linearize", local_attn_window_size=window, local_attn_older_keys="linear",
                    local_attn_feature_dim=feature_dim, local_attn_sinks=sinks)


# what ``mix`` passes on to the global heads: the options of their kind, nothing that changes a shape
GLOBAL_HEAD_OPTIONS = ("feature_map", "update_rule", "use_gate", "gate_rank", "gate_temperature", "gate_granularity",
                       "use_local_conv", "local_conv_kernel")


def mix(model, n_local_attn_heads, window=64, **global_heads):
    """A copy of ``model`` made of this library's mixed layer: in every layer the first
    ``n_local_attn_heads`` heads keep their softmax over the last ``window`` keys, the others
    become global linear heads over the whole sequence, with the options ``global_heads`` (of
    ``GLOBAL_HEAD_OPTIONS``: feature map, update rule, gates, convolution; docs/layers.md). Every
    weight of ``model`` is kept; what the global heads add (gates, convolution, the delta rule's
    writing strength) starts as the library initialises it. ``model`` as ``linearize`` takes it."""
    unknown = sorted(set(global_heads) - set(GLOBAL_HEAD_OPTIONS))
    if unknown:
        raise TypeError(f"mix takes the global heads' options {GLOBAL_HEAD_OPTIONS}, not {unknown}")
    heads = model.options.get("heads", model.transformer.attention_layers[0].heads)
    if not isinstance(n_local_attn_heads, int) or not 0 <= n_local_attn_heads < heads:
        raise ValueError(f"n_local_attn_heads must be an int from 0 to heads - 1 ({heads - 1}): the heads kept "
                         f"local; the others become global, got {n_local_attn_heads!r}")
    check_int("window", window)
    if not n_local_attn_heads:  # (no local head left: no window to set)
        return _rebuilt(model, "mix", drop=("local_attn_window_size", "local_attn_exact_windowsize"),
                        n_local_attn_heads=0, **global_heads)
    return _rebuilt(model, "mix", local_attn_window_size=window, n_local_attn_heads=n_local_attn_heads,
                    **global_heads)


def _rebuilt(model, what, drop=(), **changes):
    """``model`` rebuilt with the options ``changes`` and without those named in ``drop``,
    carrying every weight over; what the new layers add starts as initialised."""
    options = dict(model.options)
    heads = options.get("heads", model.transformer.attention_layers[0].heads)
    if not (options.get("causal") and options.get("n_local_attn_heads") == heads
            and options.get("local_attn_exact_windowsize") and not options.get("local_attn_older_keys")):
        raise ValueError(f"{what} turns softmax heads into other heads: it takes a causal model whose every head is "
                         "a local head with an exact window (n_local_attn_heads == heads, "
                         "local_attn_exact_windowsize=True), as from_llama returns")
    for name in ("shift_tokens", "reversible", "receives_context", "attend_axially"):
        if options.get(name):  # (attention transfer reads each layer's input as a plain stack passes it on)
            raise ValueError(f"{what} takes a plain stack of attention and feed-forward layers, not {name}=True")
    options.update(changes)
    for name in drop:
        options.pop(name, None)
    parameter = next(model.parameters())
    rebuilt = LinearAttentionTransformerLM(**options).to(parameter.device, parameter.dtype)
    missing, unexpected = rebuilt.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) != set(added_parameters(rebuilt)):
        raise RuntimeError(f"{what}: weights not carried over: {unexpected or missing}")
    return rebuilt.eval()


def added_parameters(model):
    """The parameters ``linearize`` or ``mix`` added, by name: whatever an attention layer holds
    beyond its projections (q, k, v and output), which a softmax layer has alone: feature maps,
    weights on older keys, gates, convolutions."""
    return _attention_parameters(model, projections=False)


def _attention_parameters(model, projections=True):
    """Every attention layer's parameters by name in ``model``, their projections (``to_q``,
    ``to_kv``, ``to_out``) left out unless ``projections``."""
    return {f"{owner}.{name}": p for owner, layer in model.named_modules() if isinstance(layer, Attention)
            for name, p in layer.named_parameters() if projections or not name.startswith("to_")}


def attention_pairs(teacher, student, x):
    """For each attention layer, in order: (the teacher's input to it (normalised), the
    teacher's output, the student's layer): the teacher's own stream, no gradient. x (b, n)
    tokens; both models as ``linearize`` takes and returns them."""
    n = x.shape[1]
    positions = torch.arange(n, device=x.device)
    h = teacher.token_emb(x)
    if teacher.pos_emb is not None:
        h = h + teacher.pos_emb(positions)
    h = teacher.project_in(h)
    rotary = teacher.transformer.rotary
    place = PLAIN if rotary is None else PLAIN.but(rotary=rotary(positions))
    for (attention, feedforward), (student_attention, _) in zip(teacher.transformer.layers.blocks,
                                                                student.transformer.layers.blocks):
        normed = attention.norm(h)
        out = attention.fn.attend(normed, place)
        yield normed, out, student_attention.fn, place
        h = h + out
        h = h + feedforward(h)


def transfer_attention(student, teacher, batches, steps=None, minutes=None, lr=1e-2, checkpoint=None,
                       save_every=50, on_step=None, autocast=None):
    """Attention transfer: train the student's new parameters (``added_parameters``) alone, so
    that each attention layer's output matches the teacher's on the teacher's input to that
    layer (mean squared error; the teacher frozen, each layer's graph freed once its gradient is
    taken). AdamW at ``lr``.

    Args:
        student: ``linearize(teacher, ...)`` or ``mix(teacher, ...)``. teacher: the softmax model.
        batches: an iterable of (b, n) token tensors, the same sequence on every run (a resumed
            run skips the batches it has seen).
        steps / minutes: stop after that many steps in all / minutes of this run (or when the
            batches end).
        checkpoint: a file: the run resumes from it when it exists, and writes it every
            ``save_every`` steps and at the end (the parameters trained, the optimiser, the
            losses).
        on_step: called with (step, loss) after each step (a progress bar).
        autocast: a dtype (``torch.bfloat16``): the forward and backward run under
            ``torch.autocast`` in it, the parameters and their optimiser stay in theirs. On a
            CPU with bfloat16 instructions (AVX512-BF16, AMX) a step costs less.
    Returns the loss (the mean over the layers) of every step, the resumed ones included."""
    params = added_parameters(student)
    if not params:
        raise ValueError("the student adds no parameters to the teacher's attention, so attention transfer has "
                         "nothing to train: pass linearize(teacher), or mix(teacher, ...) with gates or a convolution")

    def step(x):
        total = 0.0
        with torch.no_grad(), _autocast(autocast, x):
            pairs = list(attention_pairs(teacher, student, x))
        for normed, target, layer, place in pairs:
            with _autocast(autocast, normed):
                out = layer.attend(normed, place)
            loss = F.mse_loss(out.float(), target.float())
            loss.backward()
            total += loss.item()
        return total / len(pairs)

    return _train((student, teacher), params, step, batches, steps, minutes, lr, checkpoint, save_every, on_step,
                  autocast)


def finetune(model, batches, steps=None, minutes=None, lr=1e-4, checkpoint=None, save_every=50, on_step=None,
             autocast=None):
    """Fine-tune a linearized or mixed model with the next-token loss, after
    ``transfer_attention``: every attention layer's parameters train (its projections, q, k, v
    and output, and what ``linearize`` or ``mix`` added), the rest stays as it was. Arguments and
    return value as ``transfer_attention``'s (the loss: the mean next-token cross-entropy)."""
    params = _attention_parameters(model)

    def step(x):
        with _autocast(autocast, x):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        return loss.item()

    return _train((model,), params, step, batches, steps, minutes, lr, checkpoint, save_every, on_step, autocast)


def _autocast(dtype, x):
    return torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None)


def _train(models, params, step, batches, steps, minutes, lr, checkpoint, save_every, on_step, autocast):
    """The loop both trainings share: ``step(x)`` computes a batch's gradients of ``params``
    (a dict by name: the only parameters of ``models`` that train) and returns its loss; AdamW
    at ``lr``; resumed from and saved to ``checkpoint``; ``models`` in eval mode meanwhile (no
    dropout), their modes and ``requires_grad`` flags restored after."""
    if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        raise TypeError(f"autocast must be None or a floating torch.dtype (torch.bfloat16), got {autocast!r}")
    optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    losses = []
    if checkpoint is not None and os.path.exists(checkpoint):
        saved = torch.load(checkpoint, map_location=next(iter(params.values())).device)
        if set(saved["parameters"]) != set(params):
            raise ValueError(f"checkpoint {checkpoint} holds other parameters than this training's")
        with torch.no_grad():
            for name, value in saved["parameters"].items():
                params[name].copy_(value)
        optimizer.load_state_dict(saved["optimizer"])
        losses = saved["losses"]

    def save():
        if checkpoint is not None:
            torch.save({"parameters": {name: p.detach() for name, p in params.items()},
                        "optimizer": optimizer.state_dict(), "losses": losses}, checkpoint)

    trained = {id(p) for p in params.values()}
    flags = [(p, p.requires_grad) for model in models for p in model.parameters()]
    modes = [(model, model.training) for model in models]
    for p, _ in flags:
        p.requires_grad_(id(p) in trained)
    for model in models:
        model.eval()
    start = time.monotonic()
    try:
        for x in itertools.islice(batches, len(losses), None):
            if (steps is not None and len(losses) >= steps) or (minutes is not None
                                                                 and time.monotonic() - start > 60 * minutes):
                break
            losses.append(step(x))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if on_step is not None:
                on_step(len(losses), losses[-1])
            if len(losses) % save_every == 0:
                save()
        save()
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for model, mode in modes:
            model.train(mode)
    return losses
