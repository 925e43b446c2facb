"""AutoregressiveWrapper and the top_k / top_p sampling filters, checked against toy nets
whose behaviour is known and against hand-rolled reference loops."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linear_attention_transformer.autoregressive import AutoregressiveWrapper, linear_cross_entropy, top_k, top_p

# ------------------------------------------------------------------------- toy nets


class Recorder:
    """Mixin: remembers what every call of the net received."""

    def _record(self, x, input_mask, kwargs):
        self.calls.append({
            "x": x.clone(),
            "input_mask": None if input_mask is None else input_mask.clone(),
            "kwargs": dict(kwargs),
            "training": self.training,
        })


class IncrementNet(Recorder, nn.Module):
    """Logits that make (last token + 1) % num_tokens the clear favourite at every position."""

    def __init__(self, num_tokens=10, max_seq_len=8):
        super().__init__()
        self.num_tokens, self.max_seq_len, self.calls = num_tokens, max_seq_len, []

    def forward(self, x, input_mask=None, **kwargs):
        self._record(x, input_mask, kwargs)
        return F.one_hot((x.long() + 1) % self.num_tokens, self.num_tokens).float() * 10.0


class ToyLM(Recorder, nn.Module):
    """Embedding (+ positions) -> causal mean over unmasked tokens -> dropout -> linear.

    The position table has exactly max_seq_len rows, so a longer input raises.
    Masked tokens contribute nothing to any position's output.
    """

    def __init__(self, num_tokens=11, dim=16, max_seq_len=8, use_pos=True, dropout=0.5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.num_tokens, self.max_seq_len, self.calls = num_tokens, max_seq_len, []
        self.emb = nn.Embedding(num_tokens, dim)
        self.pos = nn.Embedding(max_seq_len, dim) if use_pos else None
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_tokens)
        with torch.no_grad():  # sharper distributions, so sampling and argmax are meaningful
            self.head.weight.mul_(4.0)
        self.to(torch.float64)

    def _hidden(self, x, input_mask, offset=0):
        h = self.emb(x.long())
        if self.pos is not None:
            h = h + self.pos(torch.arange(offset, offset + x.shape[1], device=x.device))
        m = torch.ones_like(x, dtype=torch.bool) if input_mask is None else input_mask
        return h * m[..., None], m.to(h.dtype)

    def _out(self, total, count):
        return self.head(self.dropout(total / count.clamp(min=1.0)[..., None]))

    def forward(self, x, input_mask=None, **kwargs):
        self._record(x, input_mask, kwargs)
        h, m = self._hidden(x, input_mask)
        return self._out(h.cumsum(1), m.cumsum(1))


class CachedToyLM(ToyLM):
    """ToyLM that can also decode incrementally; its cache is (sum, count, position)."""

    supports_cache = True

    def forward(self, x, input_mask=None, cache=None, return_cache=False, **kwargs):
        self._record(x, input_mask, kwargs)
        self.calls[-1]["cache_in"] = cache
        total0, count0, offset = cache if cache is not None else (0.0, 0.0, 0)
        h, m = self._hidden(x, input_mask, offset)
        total, count = h.cumsum(1) + total0, m.cumsum(1) + count0
        logits = self._out(total, count)
        if not return_cache:
            return logits
        return logits, (total[:, -1:], count[:, -1:], offset + x.shape[1])


# -------------------------------------------------------------------- references


def reference_generate(net, prompt, steps, temperature=1.0, filter_fn=None, thres=0.9, seed=None):
    """The plain loop the wrapper must reproduce (no eos, no mask)."""
    net.eval()
    if seed is not None:
        torch.manual_seed(seed)
    seq, out = prompt, []
    with torch.no_grad():
        for _ in range(steps):
            logits = net(seq[:, -net.max_seq_len:])[:, -1]
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                if filter_fn is not None:
                    logits = filter_fn(logits, thres=thres)
                tok = torch.multinomial(F.softmax(logits / temperature, -1), 1)[:, 0]
            out.append(tok)
            seq = torch.cat((seq, tok[:, None]), 1)
    net.calls.clear()
    return torch.stack(out, 1)


def reference_top_p(row, thres):
    """Indices kept by nucleus filtering of one row of logits, by plain sorting."""
    probs = torch.softmax(row, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if kept and mass >= thres:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def kept_indices(row):
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# --------------------------------------------------------------------------- top_k


@pytest.mark.parametrize(
    "num_tokens,thres,k",
    [(10, 0.0, 10), (10, 0.5, 5), (10, 0.7, 3), (10, 0.9, 1), (10, 0.99, 1), (20, 0.9, 2),
     (7, 0.5, 4), (1000, 0.9, 100), (3, 0.999, 1)],
)
def test_top_k_keeps_exactly_k_largest(num_tokens, thres, k):
    assert k == max(1, math.ceil(round((1 - thres) * num_tokens, 9)))
    g = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(3, num_tokens, generator=g)
    before = logits.clone()
    out = top_k(logits, thres=thres)
    assert torch.equal(logits, before)  # input untouched
    for row, filtered in zip(logits, out):
        kept = kept_indices(filtered)
        assert len(kept) == k
        assert kept == set(row.topk(k).indices.tolist())
        idx = torch.tensor(sorted(kept))
        assert torch.equal(filtered[idx], row[idx])  # kept logits unchanged
        assert (filtered[~torch.isfinite(filtered)] == float("-inf")).all()


def test_top_k_exact_count_with_ties_and_batched_shape():
    logits = torch.zeros(2, 3, 10)
    out = top_k(logits, thres=0.6)
    assert out.shape == logits.shape
    assert torch.isfinite(out).sum(-1).eq(4).all()


# --------------------------------------------------------------------------- top_p


def test_top_p_hand_example():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15], dtype=torch.float64)
    logits = probs.log()
    assert kept_indices(top_p(logits, thres=0.0)) == {1}
    assert kept_indices(top_p(logits, thres=0.3)) == {1}
    assert kept_indices(top_p(logits, thres=0.7)) == {1, 2}
    assert kept_indices(top_p(logits, thres=0.85)) == {1, 2, 3}
    assert kept_indices(top_p(logits, thres=0.97)) == {0, 1, 2, 3}
    out = top_p(logits, thres=0.7)
    assert torch.equal(out[[1, 2]], logits[[1, 2]])
    assert out[0] == float("-inf") and out[3] == float("-inf")


def test_top_p_always_keeps_top_token_of_peaked_distribution():
    logits = torch.tensor([[0.0, 50.0, 1.0, 2.0]])
    out = top_p(logits, thres=0.95)
    assert kept_indices(out[0]) == {1}


@pytest.mark.parametrize("thres", [0.0, 0.1, 0.5, 0.8, 0.9, 0.99])
def test_top_p_matches_sort_reference(thres):
    g = torch.Generator().manual_seed(int(thres * 100))
    scales = torch.tensor([0.1, 1.0, 3.0, 10.0], dtype=torch.float64).repeat_interleave(8)[:, None]
    logits = torch.randn(32, 50, dtype=torch.float64, generator=g) * scales
    before = logits.clone()
    out = top_p(logits, thres=thres)
    assert torch.equal(logits, before)
    sizes = []
    for row, filtered in zip(logits, out):
        kept = kept_indices(filtered)
        assert kept == reference_top_p(row, thres)
        idx = torch.tensor(sorted(kept))
        assert torch.equal(filtered[idx], row[idx])
        sizes.append(len(kept))
    if thres >= 0.5:
        assert len(set(sizes)) > 1  # the test covers nuclei of several sizes


@pytest.mark.parametrize("fn", [top_k, top_p])
@pytest.mark.parametrize("thres", [-0.1, 1.0, 1.5])
def test_filters_reject_bad_thres(fn, thres):
    with pytest.raises(ValueError, match="thres"):
        fn(torch.randn(2, 5), thres=thres)


# ------------------------------------------------------------------------ generate


def test_greedy_hand_computed_and_1d():
    net = IncrementNet(num_tokens=10)
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.tensor([[3, 4], [7, 8]])
    out = wrapper.generate(prompt, 5, temperature=0.0)
    assert torch.equal(out, torch.tensor([[5, 6, 7, 8, 9], [9, 0, 1, 2, 3]]))
    assert out.dtype == prompt.dtype

    out1 = wrapper.generate(torch.tensor([3, 4]), 5, temperature=0.0)
    assert out1.shape == (5,)
    assert torch.equal(out1, torch.tensor([5, 6, 7, 8, 9]))


def test_output_keeps_prompt_dtype():
    wrapper = AutoregressiveWrapper(IncrementNet(num_tokens=10))
    out = wrapper.generate(torch.tensor([[3]], dtype=torch.int32), 3, temperature=0.0)
    assert out.dtype == torch.int32 and out.tolist() == [[4, 5, 6]]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.uint16, torch.int32])
def test_token_ids_of_any_integer_dtype(dtype):
    """uint8 bytes (enwik8 read as bytes) and the other integer dtypes act as int64 ids: the
    forward, the loss, the decoder's step and generate (whose output keeps the prompt's dtype)."""
    from linear_attention_transformer import LinearAttentionTransformerLM

    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(num_tokens=20, dim=16, depth=1, heads=2, max_seq_len=32, causal=True,
                                         n_local_attn_heads=1, local_attn_window_size=4).eval()
    x = torch.randint(0, 20, (2, 9))
    assert torch.equal(model(x.to(dtype)), model(x))
    wrapper = AutoregressiveWrapper(model)
    assert torch.equal(wrapper(x.to(dtype)), wrapper(x))
    with torch.no_grad():  # the one-token step
        _, ours = model(x[:, :4].to(dtype), return_cache=True)
        _, want = model(x[:, :4], return_cache=True)
        assert torch.equal(model(x[:, 4:5].to(dtype), cache=ours), model(x[:, 4:5], cache=want))
    out = wrapper.generate(x[:, :4].to(dtype), 5, temperature=0.0)
    assert out.dtype == dtype and torch.equal(out.long(), wrapper.generate(x[:, :4], 5, temperature=0.0))


def test_a_prompt_dtype_too_narrow_for_the_vocabulary_is_refused():
    """generate returns ids in the prompt's dtype: one that cannot hold them is refused, not wrapped."""
    from linear_attention_transformer import LinearAttentionTransformerLM

    model = LinearAttentionTransformerLM(num_tokens=300, dim=16, depth=1, heads=2, max_seq_len=32, causal=True)
    with pytest.raises(ValueError, match="start_tokens of dtype torch.uint8 cannot hold the token ids up to 299"):
        AutoregressiveWrapper(model).generate(torch.tensor([[3, 4]], dtype=torch.uint8), 3)


def test_greedy_equals_hand_rolled_loop():
    net = ToyLM()
    prompt = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(1))
    expected = reference_generate(net, prompt, 12, temperature=0.0)
    out = AutoregressiveWrapper(net).generate(prompt, 12, temperature=0.0)
    assert torch.equal(out, expected)
    assert len(set(out.flatten().tolist())) > 1


@pytest.mark.parametrize("filter_fn,thres,temperature", [
    (None, 0.9, 1.0), (top_k, 0.7, 1.0), (top_p, 0.8, 0.7), (top_k, 0.0, 2.0),
])
def test_sampling_equals_hand_rolled_loop_with_same_seed(filter_fn, thres, temperature):
    net = ToyLM()
    prompt = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(2))
    expected = reference_generate(net, prompt, 15, temperature, filter_fn, thres, seed=123)
    torch.manual_seed(123)
    out = AutoregressiveWrapper(net).generate(
        prompt, 15, temperature=temperature, filter_logits_fn=filter_fn, filter_thres=thres)
    assert torch.equal(out, expected)
    # it really samples: not every row follows the greedy path
    greedy = reference_generate(net, prompt, 15, temperature=0.0)
    assert not torch.equal(out, greedy)


def test_top_k_filter_restricts_samples_to_top_tokens():
    net = ToyLM()
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.randint(0, 11, (8, 3), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    out = wrapper.generate(prompt, 6, temperature=5.0, filter_logits_fn=top_k, filter_thres=0.85)
    k = math.ceil(0.15 * 11)  # 2
    for step, call in enumerate(list(net.calls)):
        logits = net.eval()(call["x"].clone())[:, -1]  # recorded inside inference mode
        allowed = logits.topk(k, -1).indices
        assert (allowed == out[:, step:step + 1]).any(-1).all()


def test_filter_called_with_thres_only_when_sampling():
    seen = []

    def keep_token_2(logits, thres):
        seen.append(thres)
        out = torch.full_like(logits, float("-inf"))
        out[:, 2] = 0.0
        return out

    wrapper = AutoregressiveWrapper(IncrementNet(num_tokens=10))
    prompt = torch.tensor([[3], [6]])
    greedy = wrapper.generate(prompt, 3, temperature=0.0, filter_logits_fn=keep_token_2)
    assert seen == [] and greedy.tolist() == [[4, 5, 6], [7, 8, 9]]
    sampled = wrapper.generate(prompt, 3, filter_logits_fn=keep_token_2, filter_thres=0.25)
    assert seen == [0.25] * 3 and (sampled == 2).all()


def test_window_slides_beyond_max_seq_len():
    net = ToyLM(max_seq_len=8)
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(4))
    out = wrapper.generate(prompt, 10, temperature=0.0)
    full = torch.cat((prompt, out), 1)
    lengths = [c["x"].shape[1] for c in net.calls]
    assert lengths == [5, 6, 7, 8, 8, 8, 8, 8, 8, 8]
    for step, call in enumerate(net.calls):
        end = 5 + step
        assert torch.equal(call["x"], full[:, max(0, end - 8):end])


def test_prompt_longer_than_max_seq_len_is_cut():
    net = ToyLM(max_seq_len=8)
    prompt = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(net, prompt, 4, temperature=0.0)
    out = AutoregressiveWrapper(net).generate(prompt, 4, temperature=0.0)
    assert torch.equal(out, expected)
    assert torch.equal(net.calls[0]["x"], prompt[:, -8:])
    assert all(c["x"].shape[1] == 8 for c in net.calls)


def test_eos_stops_when_all_rows_done_and_pads():
    net = IncrementNet(num_tokens=10)
    wrapper = AutoregressiveWrapper(net, pad_value=9)
    prompt = torch.tensor([[1], [4]])
    out = wrapper.generate(prompt, 10, eos_token=5, temperature=0.0)
    # row 0: 2 3 4 5 -> done after 4 steps; row 1: 5 at once, then pad
    assert torch.equal(out, torch.tensor([[2, 3, 4, 5], [5, 9, 9, 9]]))
    assert len(net.calls) == 4
    # the net reads a finished row's own picks, not the pad value
    assert net.calls[-1]["x"][1].tolist() == [4, 5, 6, 7]


def test_eos_not_reached_by_every_row_keeps_full_length():
    wrapper = AutoregressiveWrapper(IncrementNet(num_tokens=10), pad_value=0)
    out = wrapper.generate(torch.tensor([[1], [6]]), 6, eos_token=4, temperature=0.0)
    # row 0 hits 4 at step 3; row 1 (7 8 9 0 1 2) never does
    assert torch.equal(out, torch.tensor([[2, 3, 4, 0, 0, 0], [7, 8, 9, 0, 1, 2]]))


def test_eos_with_sampling_pads_after_eos():
    net = ToyLM(num_tokens=5)
    wrapper = AutoregressiveWrapper(net, pad_value=-1)
    prompt = torch.randint(0, 5, (16, 2), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(1)
    out = wrapper.generate(prompt, 20, eos_token=3, temperature=1.0, filter_logits_fn=None)
    seen_eos = False
    for row in out.tolist():
        if 3 in row:
            seen_eos = True
            i = row.index(3)
            assert all(t == -1 for t in row[i + 1:])
            assert -1 not in row[:i]
        else:
            assert len(row) == 20 and -1 not in row
    assert seen_eos
    if out.shape[1] < 20:
        assert (out == 3).any(1).all()


def test_input_mask_is_extended_and_windowed():
    net = ToyLM(max_seq_len=5)
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.tensor([[0, 0, 7, 8], [1, 2, 3, 4]])
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    prompt_before, mask_before = prompt.clone(), mask.clone()
    out = wrapper.generate(prompt, 4, temperature=0.0, input_mask=mask)
    assert torch.equal(prompt, prompt_before) and torch.equal(mask, mask_before)

    full_x = torch.cat((prompt, out), 1)
    full_mask = torch.cat((mask, torch.ones(2, 4, dtype=torch.bool)), 1)
    assert len(net.calls) == 4
    for step, call in enumerate(net.calls):
        end = 4 + step
        start = max(0, end - 5)
        assert torch.equal(call["x"], full_x[:, start:end])
        assert torch.equal(call["input_mask"], full_mask[:, start:end])
    assert net.calls[2]["input_mask"][0].tolist() == [False, True, True, True, True]
    assert net.calls[3]["input_mask"][0].tolist() == [True, True, True, True, True]


def test_left_padded_batch_matches_unpadded_single_prompts():
    net = ToyLM(use_pos=False, max_seq_len=16)
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.tensor([[0, 0, 0, 5, 9], [1, 2, 3, 4, 6]])
    mask = torch.tensor([[False, False, False, True, True], [True] * 5])
    out = wrapper.generate(prompt, 6, temperature=0.0, input_mask=mask)
    alone0 = wrapper.generate(torch.tensor([5, 9]), 6, temperature=0.0)
    alone1 = wrapper.generate(torch.tensor([1, 2, 3, 4, 6]), 6, temperature=0.0)
    assert torch.equal(out[0], alone0) and torch.equal(out[1], alone1)
    # without the mask the padding changes the answer for row 0
    unmasked = wrapper.generate(prompt, 6, temperature=0.0)
    assert not torch.equal(unmasked[0], alone0)


def test_1d_prompt_with_1d_mask():
    net = ToyLM(use_pos=False)
    wrapper = AutoregressiveWrapper(net)
    out = wrapper.generate(torch.tensor([0, 0, 5, 9]), 3, temperature=0.0,
                           input_mask=torch.tensor([False, False, True, True]))
    assert out.shape == (3,)
    assert torch.equal(out, wrapper.generate(torch.tensor([5, 9]), 3, temperature=0.0))
    assert net.calls[0]["input_mask"].shape == (1, 4)


def test_other_kwargs_pass_through_unchanged():
    net = IncrementNet()
    context, context_mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    AutoregressiveWrapper(net).generate(torch.tensor([[1], [2]]), 3, temperature=0.0,
                                        context=context, context_mask=context_mask)
    assert len(net.calls) == 3
    for call in net.calls:
        assert set(call["kwargs"]) == {"context", "context_mask"}
        assert call["kwargs"]["context"] is context
        assert call["kwargs"]["context_mask"] is context_mask
        assert call["input_mask"] is None


def test_net_runs_in_eval_and_training_modes_are_restored():
    net = ToyLM()
    net.train()
    net.head.eval()  # a mixed state must come back exactly as it was
    modes = {name: m.training for name, m in net.named_modules()}
    AutoregressiveWrapper(net).generate(torch.tensor([[1, 2]]), 3)
    assert [c["training"] for c in net.calls] == [False] * 3
    assert {name: m.training for name, m in net.named_modules()} == modes
    assert net.training and net.dropout.training and not net.head.training

    net.eval()
    AutoregressiveWrapper(net).generate(torch.tensor([[1, 2]]), 2)
    assert not any(m.training for m in net.modules())


def test_training_mode_restored_after_error():
    class Failing(IncrementNet):
        def forward(self, x, input_mask=None, **kwargs):
            if len(self.calls) == 2:
                raise RuntimeError("boom")
            return super().forward(x, input_mask, **kwargs)

    net = Failing()
    net.train()
    with pytest.raises(RuntimeError, match="boom"):
        AutoregressiveWrapper(net).generate(torch.tensor([[1]]), 5)
    assert net.training


# ------------------------------------------------------------------------ use_cache


def test_use_cache_true_without_support_raises():
    wrapper = AutoregressiveWrapper(ToyLM())
    with pytest.raises(ValueError, match="use_cache"):
        wrapper.generate(torch.tensor([[1]]), 2, use_cache=True)
    net = ToyLM()
    net.supports_cache = "yes"  # only True counts
    with pytest.raises(ValueError, match="use_cache"):
        AutoregressiveWrapper(net).generate(torch.tensor([[1]]), 2, use_cache=True)


def test_default_recomputes_for_net_without_cache():
    net = ToyLM()
    AutoregressiveWrapper(net).generate(torch.tensor([[1, 2]]), 3)
    assert [c["x"].shape[1] for c in net.calls] == [2, 3, 4]
    assert all("cache" not in c["kwargs"] and "return_cache" not in c["kwargs"] for c in net.calls)


@pytest.mark.parametrize("masked", [False, True])
def test_cached_path_equals_recompute(masked):
    net = CachedToyLM(max_seq_len=6)
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.tensor([[0, 3, 4], [5, 6, 7]])
    mask = torch.tensor([[not masked, True, True], [True, True, True]])
    recompute = wrapper.generate(prompt, 7, temperature=0.0, use_cache=False, input_mask=mask)
    assert all(c["cache_in"] is None for c in net.calls)
    net.calls.clear()
    cached = wrapper.generate(prompt, 7, temperature=0.0, input_mask=mask)  # None -> cache
    assert torch.equal(cached, recompute)
    # primed with the prompt, then one token per step until the window (6) is exceeded,
    # then rebuilt from the last 6 tokens each step
    assert [c["x"].shape[1] for c in net.calls] == [3, 1, 1, 1, 6, 6, 6]
    assert [c["cache_in"] is None for c in net.calls] == [True, False, False, False, True, True, True]
    # the prompt's and the rebuilding calls take the mask; a one-token call has a real token and the cache alone
    assert all(c["input_mask"].shape == c["x"].shape for c in net.calls if c["cache_in"] is None)
    assert all(c["input_mask"] is None for c in net.calls if c["cache_in"] is not None)
    assert net.calls[0]["input_mask"][0, 0].item() == (not masked)

    torch.manual_seed(7)
    sampled_cached = wrapper.generate(prompt, 7, use_cache=True, input_mask=mask)
    torch.manual_seed(7)
    sampled_recompute = wrapper.generate(prompt, 7, use_cache=False, input_mask=mask)
    assert torch.equal(sampled_cached, sampled_recompute)


# ----------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(start_tokens=torch.tensor([[1.0, 2.0]])), TypeError, "start_tokens"),
    (dict(start_tokens=torch.tensor([[True]])), TypeError, "start_tokens"),
    (dict(start_tokens=[1, 2]), TypeError, "start_tokens"),
    (dict(start_tokens=torch.zeros(1, 0, dtype=torch.long)), ValueError, "start_tokens"),
    (dict(start_tokens=torch.zeros(1, 1, 2, dtype=torch.long)), ValueError, "start_tokens"),
    (dict(seq_len=0), ValueError, "seq_len"),
    (dict(seq_len=-3), ValueError, "seq_len"),
    (dict(seq_len=2.0), TypeError, "seq_len"),
    (dict(filter_thres=1.0), ValueError, "filter_thres"),
    (dict(filter_thres=-0.01), ValueError, "filter_thres"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(filter_logits_fn="top_k"), TypeError, "filter_logits_fn"),
    (dict(use_cache="yes"), TypeError, "use_cache"),
    (dict(eos_token=1.5), TypeError, "eos_token"),
    (dict(input_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "input_mask"),
    (dict(input_mask=torch.ones(1, 2, dtype=torch.long)), TypeError, "input_mask"),
    (dict(input_mask=torch.tensor([[True, False]])), ValueError, "input_mask"),
])
def test_generate_rejects_bad_inputs(kwargs, exc, name):
    net = IncrementNet()
    args = dict(start_tokens=torch.tensor([[1, 2]]), seq_len=3)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        AutoregressiveWrapper(net).generate(**args)
    assert net.calls == []  # rejected before the net ran


def test_wrapper_requires_max_seq_len():
    with pytest.raises(ValueError, match="max_seq_len"):
        AutoregressiveWrapper(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- loss


def test_loss_equals_cross_entropy_by_hand():
    net = ToyLM(dropout=0.0)
    wrapper = AutoregressiveWrapper(net)
    x = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(8))
    loss = wrapper(x)
    logits = net(x[:, :-1])
    expected = F.cross_entropy(logits.reshape(-1, 11), x[:, 1:].reshape(-1))
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    assert torch.equal(net.calls[0]["x"], x[:, :-1])
    loss.backward()
    assert net.head.weight.grad is not None and net.head.weight.grad.abs().sum() > 0


def test_loss_ignore_index():
    net = ToyLM(dropout=0.0)
    wrapper = AutoregressiveWrapper(net, ignore_index=0)
    x = torch.tensor([[1, 0, 2, 0, 3, 4], [5, 6, 0, 0, 7, 8]])
    loss = wrapper(x)
    log_probs = net(x[:, :-1]).log_softmax(-1)
    targets = x[:, 1:]
    picked = log_probs.gather(-1, targets[..., None])[..., 0]
    keep = targets != 0
    expected = -picked[keep].mean()
    assert keep.sum() == 6
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    unweighted = F.cross_entropy(log_probs.reshape(-1, 11), targets.reshape(-1))
    assert not torch.allclose(loss, unweighted)


def test_loss_with_input_mask_ignores_masked_targets():
    net = ToyLM(dropout=0.0)
    wrapper = AutoregressiveWrapper(net)
    x = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(9))
    mask = torch.tensor([[False, False, True, True, True, True, True],
                         [True, True, True, True, True, False, False]])
    x_before, mask_before = x.clone(), mask.clone()
    loss = wrapper(x, input_mask=mask)
    assert torch.equal(x, x_before) and torch.equal(mask, mask_before)
    assert torch.equal(net.calls[0]["input_mask"], mask[:, :-1])

    log_probs = net(x[:, :-1], input_mask=mask[:, :-1]).log_softmax(-1)
    picked = log_probs.gather(-1, x[:, 1:, None])[..., 0]
    expected = -picked[mask[:, 1:]].mean()
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)

    # masked tokens can be anything: the loss does not change
    scrambled = x.masked_fill(~mask, 10)
    assert torch.allclose(wrapper(scrambled, input_mask=mask), loss, rtol=0, atol=1e-12)


def test_return_loss_false_returns_net_output():
    net = ToyLM(dropout=0.0)
    x = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(10))
    mask = torch.ones(2, 5, dtype=torch.bool)
    out = AutoregressiveWrapper(net)(x, return_loss=False, input_mask=mask)
    assert out.shape == (2, 5, 11)
    assert torch.equal(out, net(x))
    assert torch.equal(net.calls[0]["input_mask"], mask)


@pytest.mark.parametrize("x,kwargs,exc,name", [
    (torch.randn(2, 5), {}, TypeError, "x"),
    (torch.zeros(2, 1, dtype=torch.long), {}, ValueError, "x"),
    (torch.zeros(5, dtype=torch.long), {}, ValueError, "x"),
    (torch.zeros(2, 5, dtype=torch.long), {"input_mask": torch.ones(2, 4, dtype=torch.bool)},
     ValueError, "input_mask"),
])
def test_loss_rejects_bad_inputs(x, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        AutoregressiveWrapper(ToyLM())(x, **kwargs)


# ------------------------------------------------------------------- chunked loss


def plain_linear_cross_entropy(features, weight, bias, targets, ignore_index):
    return F.cross_entropy(F.linear(features, weight, bias), targets, ignore_index=ignore_index)


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 37, 100])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_cross_entropy_equals_plain_form_float64(chunk_rows, with_bias):
    g = torch.Generator().manual_seed(11)
    D = torch.float64
    features = torch.randn(37, 5, dtype=D, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=D, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=D, generator=g, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 11, (37,), generator=g)
    targets[::5] = -1  # ignored rows, not a multiple of any chunk
    params = [t for t in (features, weight, bias) if t is not None]

    loss = linear_cross_entropy(features, weight, bias, targets, ignore_index=-1, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(3.7 * loss, params)
    expected = plain_linear_cross_entropy(features, weight, bias, targets, -1)
    expected_grads = torch.autograd.grad(3.7 * expected, params)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ignored", [False, True])
def test_linear_cross_entropy_reads_nothing_back(ignored):
    """Forward and backward make no host sync (no check whether any row is ignored), so the
    loss compiles without a graph break and lets a GPU run ahead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name().split(".")[0] in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero",
                                             "aten::is_nonzero", "aten::equal"):
                self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    features = torch.randn(12, 5, requires_grad=True)
    weight = torch.randn(7, 5, requires_grad=True)
    targets = torch.randint(0, 7, (12,))
    if ignored:
        targets[::3] = -100
    with Syncs() as mode:
        linear_cross_entropy(features, weight, None, targets, chunk_rows=5).backward()
    assert mode.names == []


def test_linear_cross_entropy_nan_when_nothing_counted_and_no_grad_path():
    features, weight = torch.randn(4, 3), torch.randn(6, 3)
    targets = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(features, weight, None, targets))
    targets = torch.tensor([0, 5, 2, 1])
    with torch.no_grad():  # no gradients formed, same value
        value = linear_cross_entropy(features, weight, None, targets, chunk_rows=3)
    torch.testing.assert_close(value, plain_linear_cross_entropy(features, weight, None, targets, -100))
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(features, weight, None, targets[:3])
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(features, weight, None, targets, chunk_rows=0)


def test_linear_cross_entropy_total_count_divides_the_summed_loss():
    """``total_count`` (the counted rows of a whole sequence split over processes) replaces
    the local count: loss and gradients are the plain summed form over that count."""
    g = torch.Generator().manual_seed(5)
    features = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 6, (9,), generator=g)
    targets[2] = -100
    loss = linear_cross_entropy(features, weight, None, targets, chunk_rows=4, total_count=torch.tensor(23))
    grads = torch.autograd.grad(loss, (features, weight))
    summed = F.cross_entropy(F.linear(features, weight), targets, reduction="sum") / 23
    torch.testing.assert_close(loss, summed, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(summed, (features, weight))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for bad in (2.5, True, torch.tensor([3]), torch.tensor(3.0)):
        with pytest.raises(TypeError, match="total_count"):
            linear_cross_entropy(features, weight, None, targets, total_count=bad)


def test_linear_cross_entropy_under_bfloat16_autocast_is_finite_and_close():
    g = torch.Generator().manual_seed(12)
    features = (30 * torch.randn(64, 16, generator=g)).requires_grad_()  # large logits
    weight = torch.randn(300, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(features, weight, None, targets, chunk_rows=10)
    loss.backward()
    expected = plain_linear_cross_entropy(features.detach(), weight.detach(), None, targets, -100)
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert torch.isfinite(features.grad).all() and torch.isfinite(weight.grad).all()
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=0)


def small_lm(tie):
    from linear_attention_transformer import LinearAttentionTransformerLM

    return LinearAttentionTransformerLM(
        num_tokens=23, dim=16, emb_dim=6, tie_embedding=tie, depth=2, heads=4, max_seq_len=32, causal=True,
        n_local_attn_heads=2, local_attn_window_size=4, blindspot_size=4, shift_tokens=True, reversible=True,
    ).double()


@pytest.mark.parametrize("tie", [False, True])
def test_wrapper_chunked_loss_equals_plain_loss_and_gradients(tie, monkeypatch):
    torch.manual_seed(13)
    net = small_lm(tie)
    wrapper = AutoregressiveWrapper(net, ignore_index=3)
    x = torch.randint(0, 23, (2, 19))
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[1, 15:] = False  # right padding
    assert wrapper._output_layer() is net.to_logits

    import linear_attention_transformer.autoregressive as ar
    monkeypatch.setattr(ar, "LOSS_CHUNK_ELEMENTS", 23 * 5)  # chunks of 5 rows: 36 rows in all
    monkeypatch.setattr(type(net), "forward", lambda *a, **k: pytest.fail("the chunked loss formed the logits"))
    loss = wrapper(x, input_mask=mask)
    grads = torch.autograd.grad(loss, list(net.parameters()))
    monkeypatch.undo()

    targets = x[:, 1:].masked_fill(~mask[:, 1:], 3)
    logits = net(x[:, :-1], input_mask=mask[:, :-1])
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=3)
    expected_grads = torch.autograd.grad(expected, list(net.parameters()))
    assert (x[:, 1:] == 3).any()  # ignore_index acts as well as the mask
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-10)


def test_loss_chunks_are_larger_off_the_cpu(monkeypatch):
    """Off the CPU a chunk's cost is its launches: the default budget is larger there, and the
    chunked loss asks for the budget of the device its features are on."""
    import linear_attention_transformer.autoregressive as ar
    assert ar.loss_chunk_elements(torch.device("cpu")) == ar.LOSS_CHUNK_ELEMENTS
    assert ar.loss_chunk_elements("cuda") == ar.LOSS_CHUNK_ELEMENTS_ACCELERATOR > ar.LOSS_CHUNK_ELEMENTS
    asked = []
    monkeypatch.setattr(ar, "loss_chunk_elements", lambda device: asked.append(device) or 5 * 7)
    features, weight = torch.randn(12, 4, requires_grad=True), torch.randn(7, 4)
    targets = torch.randint(0, 7, (12,))
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(ar.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real_linear(*a))
    loss = ar.linear_cross_entropy(features, weight, None, targets)
    monkeypatch.undo()
    assert asked == [features.device] and calls == [5, 5, 2]
    torch.testing.assert_close(loss, F.cross_entropy(features @ weight.t(), targets))


def test_wrapper_return_loss_false_still_returns_logits():
    net = small_lm(False)
    x = torch.randint(0, 23, (2, 9))
    out = AutoregressiveWrapper(net)(x, return_loss=False)
    assert out.shape == (2, 9, 23)
    assert torch.equal(out, net(x))


def test_generate_past_max_seq_len_steps_only_within_it(monkeypatch):
    # a position table's model: past max_seq_len (32) every call rebuilds the cache from its
    # own last 32 tokens, so one-token steps run only while the sequence fits
    torch.manual_seed(5)
    net = small_lm(False).eval()
    wrapper = AutoregressiveWrapper(net)
    prompt = torch.randint(0, 23, (2, 10))
    recomputed = wrapper.generate(prompt, 40, temperature=0, use_cache=False)
    steps = []
    attend = net.transformer.attend
    monkeypatch.setattr(net.transformer, "attend",
                        lambda x, place, *args: steps.extend([1] * place.step) or attend(x, place, *args))
    cached = wrapper.generate(prompt, 40, temperature=0, use_cache=True)
    assert torch.equal(cached, recomputed)  # 10 + 40 tokens: 18 steps beyond max_seq_len = 32
    assert len(steps) == 32 - 10  # the sequences of 11 to 32 tokens
