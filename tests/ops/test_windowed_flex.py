"""The local heads' flex_attention implementation (``ops/windowed_flex.py``) against the plain
masked softmax (``windowed_attention_by_position``), and the choice of implementation
(``local_implementation``).

There is no GPU here: flex_attention runs eagerly on the CPU (unfused, forward only, float64
accepted), which checks the mask and the readout, not the CUDA kernel (the CPU's compiled
flex is wrong on some calls in torch 2.13: ops/windowed_flex.py)."""

import pytest
import torch

import linear_attention_transformer.heads as heads_module
from linear_attention_transformer.attention import Attention
from linear_attention_transformer.ops.segments import positions_in_segment, segment_runs
from linear_attention_transformer.ops.windowed_attention import Window, windowed_attention_by_position
from linear_attention_transformer.ops import windowed_flex
from linear_attention_transformer.ops.windowed_flex import flex_windowed_attention, local_implementation

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

D = torch.float64
W = 8
WINDOWS = [  # (look_backward, look_forward, causal, exact)
    (1, 0, True, False),
    (2, 0, True, False),
    (0, 0, True, False),
    (1, 0, True, True),
    (2, 0, True, True),
    (0, 1, False, False),
    (1, 1, False, False),
    (2, 0, False, False),
]


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 16, dtype=D, generator=g) for _ in range(3))
    key_mask = torch.rand(2, n, generator=g) > 0.3
    key_mask[1, :12] = False  # the first 12 queries of row 1 then see no key when causal
    segments = torch.tensor([[0] * 10 + [1] * 19 + [2] * (n - 29), [4] * n])
    return q, k, v, key_mask, segments


def plain(q, k, v, window, key_mask, segments):
    n = q.shape[2]
    if segments is None:
        positions = torch.arange(n)
        return windowed_attention_by_position(q, k, v, positions, positions, window, key_mask)
    runs = segment_runs(segments)
    positions = positions_in_segment(runs)
    return windowed_attention_by_position(q, k, v, positions, positions, window, key_mask, runs, runs)


@pytest.mark.parametrize("options", WINDOWS, ids=str)
@pytest.mark.parametrize("n, masked, packed", [(37, False, False), (32, True, False), (37, False, True),
                                               (37, True, True)])
def test_flex_equals_the_plain_form(options, n, masked, packed):
    q, k, v, key_mask, segments = inputs(n, seed=n + 10 * masked + 100 * packed)
    window = Window(W, *options)
    key_mask, segments = (key_mask if masked else None), (segments if packed else None)
    out = flex_windowed_attention(q, k, v, window, key_mask, segments)
    reference = plain(q, k, v, window, key_mask, segments)
    assert torch.isfinite(out).all()
    err = (out - reference).abs().max().item()
    assert err <= 1e-12, f"max error {err:.2e}"
    if masked and window.causal:  # no visible key: 0, as windowed_attention gives
        assert torch.equal(out[1, :, :12], torch.zeros_like(out[1, :, :12]))


@pytest.mark.parametrize("options", [WINDOWS[0], WINDOWS[4], WINDOWS[5], WINDOWS[6]], ids=str)
def test_non_finite_inputs_poison_what_sees_them(options):
    q, k, v, key_mask, segments = inputs(37, seed=7)
    k[0, 1, 20, 3] = float("nan")
    v[1, 0, 30, 0] = float("inf")
    v[1, 2, 5, 1] = float("nan")  # a masked key (key_mask[1, :12] is False): seen by no query
    q[0, 0, 33, 2] = float("nan")
    window = Window(W, *options)
    out = flex_windowed_attention(q, k, v, window, key_mask, segments)
    reference = plain(q, k, v, window, key_mask, segments)
    assert torch.equal(out.isnan(), reference.isnan())
    assert 0 < reference.isnan().sum() < reference.numel()
    err = (out - reference).nan_to_num().abs().max().item()
    assert err <= 1e-12, f"max error {err:.2e}"


def test_the_implementation_by_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert local_implementation(cpu, D) == "windowed"
    assert local_implementation(cpu, torch.float32) == "windowed"
    assert local_implementation(cuda, torch.float32, head_dim=64) == "flex"
    assert local_implementation(cuda, torch.bfloat16, head_dim=16) == "flex"
    assert local_implementation(cuda, torch.bfloat16, head_dim=8) == "windowed"  # under the kernel's smallest dot
    assert local_implementation(cuda, D, head_dim=64) == "windowed"
    assert local_implementation(cuda, torch.float32, "torch", head_dim=64) == "windowed"
    assert local_implementation(cuda, torch.float32, "fla", head_dim=64) == "flex"
    assert local_implementation(cpu, torch.float32, "fla", head_dim=64) == "windowed"
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'torch', 'fla'"):
        local_implementation(cpu, D, "triton")


@torch.no_grad()  # flex_attention has no backward on the CPU
def test_the_layer_runs_the_picked_implementation(monkeypatch):
    torch.manual_seed(0)
    layer = Attention(32, heads=4, causal=True, n_local_attn_heads=2, local_attn_window_size=W).to(D).eval()
    x = torch.randn(2, 37, 32, dtype=D)
    mask = torch.rand(2, 37) > 0.2
    segment_ids = torch.tensor([[0] * 15 + [1] * 22, [0] * 37])

    def refuse(*args):
        raise AssertionError("flex called on the CPU")

    monkeypatch.setattr(heads_module, "flex_windowed_attention", refuse)
    windowed = layer(x, input_mask=mask, segment_ids=segment_ids)  # 'auto' on the CPU: 'windowed'
    monkeypatch.undo()
    monkeypatch.setattr(heads_module, "local_implementation", lambda *args: "flex")
    flex = layer(x, input_mask=mask, segment_ids=segment_ids)
    err = (flex - windowed).abs().max().item()
    assert err <= 1e-12, f"max error {err:.2e}"


@torch.no_grad()
def test_the_layers_kernel_option_picks_the_local_implementation(monkeypatch):
    """The layer hands its kernel to ``local_implementation`` (whose answer for 'torch' is
    'windowed' on every device)."""
    asked = []
    monkeypatch.setattr(heads_module, "local_implementation", lambda *args: asked.append(args[2:]) or "windowed")
    x = torch.randn(2, 20, 32)
    for kernel in ("auto", "torch"):  # (a layer without a causal order takes 'torch' too)
        Attention(32, heads=4, n_local_attn_heads=2, local_attn_window_size=W, kernel=kernel)(x)
    assert asked == [("auto", 8), ("torch", 8)]


# ------------------------------------------------------------------ the block mask and the compiled kernel


def dense_blocks(num, indices, c):
    """The (c, c) bool matrix of the blocks that (num, indices) name (None: none)."""
    blocks = torch.zeros(c, c, dtype=torch.bool)
    if num is None:
        return blocks
    for row in range(c):
        blocks[row, indices[0, 0, row, :num[0, 0, row]].long()] = True
    return blocks


@pytest.mark.parametrize("n", [1, 128, 300, 513])
@pytest.mark.parametrize("size", [8, 100, 256])
@pytest.mark.parametrize("options", WINDOWS, ids=str)
def test_the_block_mask_is_create_block_masks_without_the_grid(monkeypatch, n, size, options):
    """The window's block structure, built from block ends (``window_blocks``), is the one
    ``create_block_mask`` finds by evaluating the rule at every (query, key) pair: the same
    masked blocks and the same full ones; and building it evaluates the rule at no pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    window = Window(size, *options)
    reference = create_block_mask(lambda b, h, i, j: window.visible(i, j), None, None, n, n, device="cpu")
    c = reference.kv_num_blocks.shape[-1]
    monkeypatch.setattr(Window, "visible", lambda *args: pytest.fail("the rule evaluated pair by pair"))
    blocks = windowed_flex.window_blocks(n, window, torch.device("cpu"))
    assert torch.equal(dense_blocks(*blocks[:2], c), dense_blocks(reference.kv_num_blocks, reference.kv_indices, c))
    assert torch.equal(dense_blocks(*blocks[2:], c),
                       dense_blocks(reference.full_kv_num_blocks, reference.full_kv_indices, c))


def needed_blocks(window, segments):
    """(c, c): the blocks holding a pair the rule makes visible with ``segments`` (1, n)."""
    n = segments.shape[1]
    runs = segment_runs(segments)
    positions = positions_in_segment(runs)[0]
    visible = window.visible(positions[:, None], positions[None, :]) & (runs[0][:, None] == runs[0][None, :])
    c = -(-n // 128)
    return torch.nn.functional.pad(visible, (0, c * 128 - n, 0, c * 128 - n)).reshape(c, 128, c, 128).any(3).any(1)


SEGMENTS = torch.tensor([[0] * 30 + [1] * 333 + [2] * 200 + [3] * 137])


@pytest.mark.parametrize("size", [100, 128])
@pytest.mark.parametrize("options", WINDOWS, ids=str)
def test_segments_keep_every_visible_pair_in_a_masked_block(size, options):
    """With segments (windows counted from each segment's start) the visited blocks hold every
    pair the rule makes visible, and none is full: ``mask_mod`` masks every visited block."""
    window, c = Window(size, *options), 6
    blocks = windowed_flex.window_blocks(700, window, torch.device("cpu"), widen=True, full=False)
    visited = dense_blocks(*blocks[:2], c)
    assert torch.equal(visited | needed_blocks(window, SEGMENTS), visited) and blocks[2] is None


def test_segments_need_the_wider_window():
    """(Not vacuous: the plain window's blocks, full ones included, miss some segment's pairs.)"""
    window = Window(128, 1, 1, False)
    plain = windowed_flex.window_blocks(700, window, torch.device("cpu"))
    plain = dense_blocks(*plain[:2], 6) | dense_blocks(*plain[2:], 6)
    assert not torch.equal(plain | needed_blocks(window, SEGMENTS), plain)


@torch.no_grad()
def test_one_block_structure_serves_every_call_and_layer():
    windowed_flex._cached_blocks.cache_clear()
    layers = [Attention(32, heads=4, causal=True, n_local_attn_heads=2, local_attn_window_size=W).to(D).eval()
              for _ in range(2)]
    x = torch.randn(2, 37, 32, dtype=D)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(heads_module, "local_implementation", lambda *args: "flex")
        for _ in range(2):
            for layer in layers:
                layer(x)
    info = windowed_flex._cached_blocks.cache_info()
    assert (info.misses, info.hits) == (1, 3)


@torch.no_grad()
def test_the_compiled_kernel_traces_once_per_configuration_not_per_call(monkeypatch):
    """Where the kernel is compiled here (CUDA, eagerly; forced here, traces counted): calls of
    the same shape reuse one trace, each window has its own compiled function (so layers of
    different windows never recompile each other), and a new length retraces once, to dynamic
    shapes."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(windowed_flex, "BACKEND", counter)
    monkeypatch.setattr(windowed_flex, "_compile_here", lambda device: True)
    windowed_flex._compiled_flex.cache_clear()
    q, k, v, key_mask, _ = inputs(37, seed=3)
    counts = []
    for window, n, masked in [(W, 37, False), (W, 37, False), (16, 37, False), (W, 37, False), (W, 37, True),
                              (W, 37, True), (W, 50, False), (W, 60, False)]:
        out = flex_windowed_attention(*(t[:, :, :n] if n <= 37 else torch.cat((t, t), dim=2)[:, :, :n]
                                        for t in (q, k, v)), Window(window), key_mask if masked else None)
        counts.append(counter.frame_count)
        assert torch.isfinite(out).all()
    assert counts == [1, 1, 2, 2, 3, 3, 4, 4]
    windowed_flex._compiled_flex.cache_clear()
