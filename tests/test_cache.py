"""Cached decoding equals the full forward, token by token, for every causal component."""

import pytest
import torch
from local_attention import LocalAttention

from linear_attention_transformer import (
    AutoregressiveWrapper,
    LinearAttentionTransformer,
    LinearAttentionTransformerLM,
    LinformerSettings,
)
from linear_attention_transformer.autoregressive import top_k, top_p
from linear_attention_transformer.cache import map_tensors
from linear_attention_transformer.ops.windowed_attention import Window, windowed_attention_by_position

D = torch.float64

CONFIGS = {
    "exact global": dict(),
    "local+blindspot+shift+reversible": dict(
        n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=4, shift_tokens=True, reversible=True
    ),
    "gate+conv+axial+rotary": dict(
        use_gate=True, use_local_conv=True, attend_axially=True, local_attn_window_size=4, use_rotary_emb=True,
        n_local_attn_heads=1,
    ),
    "context+absolute+pkm+glu+kv_heads": dict(
        receives_context=True, use_axial_pos_emb=False, pkm_layers=(1,), pkm_num_keys=8, ff_chunks=2, ff_glu=True,
        kv_heads=2,
    ),
    "elu+gate+blindspot 3+conv 4+per-layer local": dict(
        feature_map="elu", use_gate=True, gate_granularity="feature", blindspot_size=3, use_local_conv=True, local_conv_kernel=4,
        n_local_attn_heads=(2, 0), local_attn_window_size=5,
    ),
    # global heads' q/k narrower (2) or wider (6) than their values and the local heads (dim_head 4)
    "dim_qk 2+taylor+gate per feature+conv 3+rotary+local+blindspot 3": dict(
        dim_qk=2, feature_map="taylor", use_gate=True, gate_granularity="feature", use_local_conv=True,
        use_rotary_emb=True, n_local_attn_heads=1, local_attn_window_size=4, blindspot_size=3,
    ),
    "dim_qk 6+kv_heads+local+rotary+context": dict(
        dim_qk=6, kv_heads=2, n_local_attn_heads=2, local_attn_window_size=4, use_rotary_emb=True, receives_context=True,
    ),
}


def make(cfg, dtype=D, seed=0):
    torch.manual_seed(seed)
    model = LinearAttentionTransformerLM(
        num_tokens=20, dim=16, depth=2, heads=4, max_seq_len=40, causal=True, chunk_size=4, **cfg
    ).to(dtype).eval()
    with torch.no_grad():  # gates and convolutions start near identity: move them
        for name, p in model.named_parameters():
            if "gate" in name or "conv" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def inputs(cfg, n=23, dtype=D):
    x = torch.randint(0, 20, (2, n))
    mask = torch.ones(2, n, dtype=torch.bool)
    if cfg.get("blindspot_size", 1) > 1:
        mask[1, 5:8] = False  # (blindspot blocks with rows padded on the left are refused in a cache)
    else:
        mask[1, :3] = False  # a left-padded prompt
    kw = {}
    if cfg.get("receives_context"):
        kw = dict(context=torch.randn(2, 7, 16, dtype=dtype), context_mask=torch.rand(2, 7) > 0.3)
    return x, mask, kw


def decode(model, x, mask, kw, prompt, step=1):
    """Prime with ``prompt`` tokens, then feed ``step`` tokens per call."""
    outs, cache = [], None
    if prompt:
        out, cache = model(x[:, :prompt], input_mask=mask[:, :prompt], return_cache=True, **kw)
        outs.append(out)
    for t in range(prompt, x.shape[1], step):
        out, cache = model(x[:, t : t + step], input_mask=mask[:, t : t + step], cache=cache, return_cache=True, **kw)
        outs.append(out)
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("prompt, step", [(0, 1), (1, 1), (6, 1), (9, 1), (5, 3)])
def test_cached_decoding_equals_full_forward_float64(name, prompt, step):
    cfg = CONFIGS[name]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    full = model(x, input_mask=mask, **kw)
    cached, cache = decode(model, x, mask, kw, prompt, step)
    scale = full[mask].abs().max()
    assert (cached - full)[mask].abs().max() <= 1e-9 * scale
    assert cache.position == x.shape[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_full_forward_float32(name):
    cfg = CONFIGS[name]
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    full = model(x, input_mask=mask, **kw)
    cached, _ = decode(model, x, mask, kw, prompt=7)
    torch.testing.assert_close(cached[mask], full[mask], rtol=1e-4, atol=1e-4)


def test_cache_is_updated_in_place_and_branches_by_clone():
    """A call with return_cache writes the new state into the cache's buffers (each keeps its
    shape and memory) and returns the same cache; to branch, clone first: a clone is
    independent of the cache it was made from, and a branch from it equals the same call
    from an untouched clone."""
    cfg = CONFIGS["local+blindspot+shift+reversible"]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    _, cache = model(x[:, :10], input_mask=mask[:, :10], return_cache=True)
    layout = [(tuple(t.shape), t.data_ptr()) for t in tensors_of(cache)]
    snapshot, branch = cache.clone(), cache.clone()
    before = [t.clone() for t in tensors_of(cache)]
    a, same = model(x[:, 10:11], cache=cache, return_cache=True)
    assert same is cache and cache.position == 11
    assert [(tuple(t.shape), t.data_ptr()) for t in tensors_of(cache)] == layout
    assert not all(torch.equal(now, was) for now, was in zip(tensors_of(cache), before))
    assert all(torch.equal(now, was) for now, was in zip(tensors_of(snapshot), before))
    b, _ = model(x[:, 11:12], cache=branch, return_cache=True)  # a different branch from the same state
    a2, _ = model(x[:, 10:11], cache=snapshot, return_cache=True)
    torch.testing.assert_close(a, a2, rtol=0, atol=0)
    assert not torch.equal(a, b)


def test_cache_without_return_cache_gives_the_output_alone():
    """A cache can be read without asking for the next one: the output alone comes back,
    equal to the output of the same call with return_cache=True, and the cache is left as it
    was."""
    cfg = CONFIGS["local+blindspot+shift+reversible"]
    model = make(cfg)
    x, mask, kw = inputs(cfg)
    _, cache = model(x[:, :10], input_mask=mask[:, :10], return_cache=True)
    before = [t.clone() for t in tensors_of(cache)]
    alone = model(x[:, 10:12], cache=cache)
    assert all(torch.equal(now, was) for now, was in zip(tensors_of(cache), before))  # read, not updated
    paired, _ = model(x[:, 10:12], cache=cache, return_cache=True)
    assert torch.is_tensor(alone)
    torch.testing.assert_close(alone, paired, rtol=0, atol=0)


def tensors_of(cache):
    found = []
    map_tensors(cache, lambda t: found.append(t) or t)
    return found


def test_cache_moves_with_to():
    cfg = CONFIGS["gate+conv+axial+rotary"]
    model = make(cfg, torch.float32)
    x, mask, kw = inputs(cfg, dtype=torch.float32)
    _, cache = model(x[:, :9], return_cache=True)
    moved = cache.to(torch.float64).to("cpu")
    dtypes = [t.dtype for t in tensors_of(moved)]
    assert torch.float64 in dtypes and torch.float32 not in dtypes
    out_a, _ = model(x[:, 9:10], cache=cache, return_cache=True)
    out_b, _ = model.to(D)(x[:, 9:10], cache=moved, return_cache=True)
    torch.testing.assert_close(out_a.double(), out_b, rtol=1e-4, atol=1e-4)


def test_transformer_on_embeddings_decodes_with_cache():
    torch.manual_seed(3)
    model = LinearAttentionTransformer(
        dim=16, depth=2, heads=4, max_seq_len=32, causal=True, n_local_attn_heads=2, local_attn_window_size=4,
        use_gate=True, chunk_size=4,
    ).to(D).eval()
    x = torch.randn(1, 13, 16, dtype=D)
    full = model(x)
    outs, cache = [], None
    for t in range(13):
        out, cache = model(x[:, t : t + 1], cache=cache, return_cache=True)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-12)


def test_windowed_attention_equals_local_attention():
    torch.manual_seed(4)
    for n, w in [(12, 4), (13, 4), (7, 3)]:
        q, k, v = (torch.randn(2, 3, n, 8, dtype=D) for _ in range(3))
        mask = torch.rand(2, n) > 0.3
        mask[:, 0] = True
        attn = LocalAttention(window_size=w, causal=True, use_rotary_pos_emb=False, autopad=True)
        ref = attn(q, k, v, mask=mask)
        pos = torch.arange(n)
        out = windowed_attention_by_position(q, k, v, pos, pos, Window(w), mask)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------ refusals


def test_cache_refused_in_train_mode_with_dropout():
    model = LinearAttentionTransformerLM(num_tokens=8, dim=16, depth=1, heads=4, max_seq_len=16, causal=True,
                                         ff_dropout=0.1)
    with pytest.raises(ValueError, match="eval"):
        model(torch.randint(0, 8, (1, 4)), return_cache=True)
    model.eval()
    model(torch.randint(0, 8, (1, 4)), return_cache=True)  # fine in eval mode


def test_cache_refused_for_noncausal_and_linformer():
    noncausal = LinearAttentionTransformerLM(num_tokens=8, dim=16, depth=1, heads=4, max_seq_len=16).eval()
    with pytest.raises(ValueError, match="causal"):
        noncausal(torch.randint(0, 8, (1, 4)), return_cache=True)
    linformer = LinearAttentionTransformerLM(
        num_tokens=8, dim=16, depth=1, heads=4, max_seq_len=16, linformer_settings=LinformerSettings(k=4)
    ).eval()
    assert not linformer.supports_cache
    with pytest.raises(ValueError, match="causal|Linformer"):
        linformer(torch.randint(0, 8, (1, 16)), return_cache=True)


def test_cache_refused_beyond_max_seq_len():
    model = make(CONFIGS["exact global"])
    _, cache = model(torch.randint(0, 20, (1, 40)), return_cache=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, 20, (1, 1)), cache=cache, return_cache=True)


# ------------------------------------------------------------------------ generation


@pytest.mark.parametrize("name", ["local+blindspot+shift+reversible", "gate+conv+axial+rotary"])
@pytest.mark.parametrize("filter_fn", [top_k, top_p])
def test_generate_cached_and_recomputed_tokens_identical(name, filter_fn):
    model = make(CONFIGS[name], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False  # left-padded batch of different prompt lengths
    if CONFIGS[name].get("blindspot_size", 1) > 1:  # refused in a cache: each row's blocks start elsewhere
        with pytest.raises(ValueError, match="blindspot_size=4 with rows padded on the left"):
            wrapper.generate(prompt, 4, input_mask=mask)
        mask[0, :2] = True
    results = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        # 45 > max_seq_len = 40: both paths slide to the last 40 tokens
        results.append(wrapper.generate(prompt, 45, filter_logits_fn=filter_fn, use_cache=use_cache, input_mask=mask))
    assert results[0].shape == (2, 45)
    assert torch.equal(results[0], results[1])


def test_generate_greedy_with_temperature_zero_matches_argmax_of_full_forward():
    model = make(CONFIGS["exact global"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    prompt = torch.randint(0, 20, (5,))
    out = wrapper.generate(prompt, 8, temperature=0.0)
    seq = prompt.clone()
    for _ in range(8):
        seq = torch.cat((seq, model(seq[None])[0, -1].argmax()[None]))
    assert out.shape == (8,) and torch.equal(out, seq[5:])


def random_config(rng):
    """A configuration drawn from the causal option space."""
    pick = lambda *options: options[int(torch.randint(len(options), (1,), generator=rng))]  # noqa: E731
    cfg = dict(
        n_local_attn_heads=pick(0, 1, 2, 4), local_attn_window_size=pick(3, 4, 5), blindspot_size=pick(1, 1, 3, 4),
        shift_tokens=pick(False, True), reversible=pick(False, True), use_gate=pick(False, True),
        use_local_conv=pick(False, True), local_conv_kernel=pick(2, 3, 4), attend_axially=pick(False, True),
        feature_map=pick("softmax", "softmax", "elu", "relu"), kv_heads=pick(None, 2),
        receives_context=pick(False, True),
    )
    if not cfg["use_local_conv"]:
        del cfg["local_conv_kernel"]
    positional = pick("axial", "rotary", "absolute")
    if cfg["use_gate"]:
        cfg["gate_granularity"] = pick("feature", "head")
    cfg.update(use_rotary_emb=positional == "rotary", use_axial_pos_emb=positional == "axial")
    if not (cfg["n_local_attn_heads"] or cfg["attend_axially"] or positional == "axial"):
        del cfg["local_attn_window_size"]  # nothing would use it: refused
    return cfg


@pytest.mark.parametrize("seed", range(8))
def test_random_configurations_decode_exactly(seed):
    cfg = random_config(torch.Generator().manual_seed(seed))
    model = make(cfg, seed=seed)
    x, mask, kw = inputs(cfg, n=17)
    full = model(x, input_mask=mask, **kw)
    prompt = int(torch.randint(0, 12, (1,), generator=torch.Generator().manual_seed(100 + seed)))
    cached, _ = decode(model, x, mask, kw, prompt)
    scale = full[mask].abs().max()
    assert (cached - full)[mask].abs().max() <= 1e-9 * scale, cfg


def test_generated_tokens_can_be_trained_on():
    """generate runs under inference mode; what it returns must still work with autograd."""
    model = make(CONFIGS["exact global"], torch.float32)
    wrapper = AutoregressiveWrapper(model)
    tokens = wrapper.generate(torch.randint(0, 20, (1, 4)), 6)
    assert not tokens.is_inference()
    model.train()
    loss = wrapper(torch.cat((torch.randint(0, 20, (1, 4)), tokens), dim=1), return_loss=True)
    loss.backward()
    assert model.token_emb.weight.grad is not None
