"""Multi-process training: 2 processes on the CPU (gloo) train the LM for a few steps, each on
its own data, and must end with the parameters of one process trained on the union of the
batches.

DistributedDataParallel and FSDP (``fully_shard``) average the gradients over the ranks, so
the single-process reference takes the mean loss over the union: with the same number of
tokens per rank that is the mean of the per-rank mean losses.

The workers are this file run as a script (``python test_distributed.py --worker ...``): all
configurations in one pair of processes, so torch is imported twice in all rather than per
configuration. The processes meet through a file store in ``tmp_path`` (no port to pick).

How a worker ends matters. A worker that returned normally died about once in 50 runs with
``terminate called without an active exception`` (SIGABRT, exit code -6) after it had saved
all its results; faulthandler showed no Python frame on its stack, so it died in interpreter
finalization. The likely mechanism (a debugger did not catch it: 40 runs under gdb passed):
gloo's C++ threads outlive ``destroy_process_group``, which shuts the groups down but frees
nothing that Python objects still reference (DDP's reducer, FSDP's state, the device mesh);
a C++ thread that takes the GIL while the interpreter finalizes is stopped by
``pthread_exit``, and its forced unwinding through a ``noexcept`` frame calls
``std::terminate`` (the message without an active exception). So a worker
(1) meets the other at a barrier, so that no rank shuts its connections while the other still
reads from them, (2) drops its models and destroys the group while Python is fully alive, and
(3) leaves with ``os._exit`` once its output is flushed, never finalizing the interpreter
with those threads running (``worker_main``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linear_attention_transformer import LinearAttentionTransformerLM
from linear_attention_transformer.transformer import Branch

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
STEPS = 3
NUM_TOKENS, BATCH, LENGTH = 24, 2, 13  # sequences of 13 tokens: 12 inputs, 12 targets
BASE = dict(num_tokens=NUM_TOKENS, dim=16, depth=2, max_seq_len=16, heads=2, causal=True, chunk_size=4)
CONFIGS = {
    "plain": dict(),
    "reversible": dict(reversible=True, shift_tokens=True, n_local_attn_heads=1, local_attn_window_size=4),
    "gate_conv": dict(use_gate=True, use_local_conv=True, n_local_attn_heads=(1, 0), local_attn_window_size=4),
}
# FSDP, wrapped per residual branch and at the root (see wrap_fsdp)
FSDP_CONFIGS = tuple(CONFIGS)


def make_model(name):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(**BASE, **CONFIGS[name])


def batch(rank, step):
    """The tokens rank ``rank`` trains on at ``step``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, NUM_TOKENS, (BATCH, LENGTH), generator=g)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])


def train(model, batches, lr=0.5, momentum=0.9):
    """SGD with momentum, ``STEPS`` steps; ``batches(step)`` gives the tokens of a step.
    Written out rather than torch.optim.SGD, whose first use imports torch._dynamo: seconds
    in each worker process."""
    params = list(model.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        for p in params:
            p.grad = None
        loss_of(model, batches(step)).backward()
        with torch.no_grad():
            for p, v in zip(params, velocity):
                v.mul_(momentum).add_(p.grad)
                p.sub_(lr * v)


def wrap_fsdp(model, name, mesh):
    """FSDP2 units: one per residual branch (attention or feed-forward, with its norm), then
    the root (embeddings, final norm, logits). A reversible stack recomputes its branches in
    its own backward, outside FSDP's hooks, so it is sharded as one unit with the root (a
    branch-level unit inside it is refused, see test_fsdp_units_inside_a_reversible_stack_are_refused)."""
    from torch.distributed.fsdp import fully_shard

    if not CONFIGS[name].get("reversible"):
        for module in model.modules():
            if isinstance(module, Branch):
                fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# --------------------------------------------------------------------------- worker


def worker(rank, store_path, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2: a Linear's 3-d output
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        for name in CONFIGS:
            model = DDP(make_model(name))
            train(model, lambda step: batch(rank, step))
            torch.save(model.module.state_dict(), Path(out_dir) / f"ddp-{name}-{rank}.pt")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        for name in FSDP_CONFIGS:
            model = wrap_fsdp(make_model(name), name, mesh)
            train(model, lambda step: batch(rank, step))
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # all-gathers the shards
            torch.save(full, Path(out_dir) / f"fsdp-{name}-{rank}.pt")
        del model, full
        dist.barrier()  # both ranks are done communicating before either shuts a connection
    finally:
        gc.collect()  # FSDP's and DDP's reference cycles (and the work they hold) go now, not at exit
        dist.destroy_process_group()


def worker_main(argv):
    """Run a worker, then leave without interpreter finalization (see the module docstring).
    A worker that raises exits through the traceback as usual: the run fails either way."""
    worker(int(argv[0]), argv[1], argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run the two workers once; return the directory holding their final parameters."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with the gloo backend is needed for these tests")
    out = tmp_path_factory.mktemp("distributed")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(out / "store"), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return out


def reference(name):
    """One process, one model, the union of the ranks' batches, the mean loss over it."""
    model = make_model(name)
    train(model, lambda step: torch.cat([batch(rank, step) for rank in range(WORLD)]))
    return model.state_dict()


def assert_same_training(trained, kind, name):
    ranks = [torch.load(trained / f"{kind}-{name}-{rank}.pt") for rank in range(WORLD)]
    want = reference(name)
    initial = make_model(name).state_dict()
    assert set(ranks[0]) == set(want)
    moved = 0.0
    for key, value in want.items():
        for rank, got in enumerate(ranks):
            assert torch.equal(got[key], ranks[0][key]), f"{key}: rank {rank} differs from rank 0"
        err = (ranks[0][key] - value).abs().max().item()
        assert err <= 1e-5, f"{key}: {kind} differs from single-process training by {err:.2e}"
        moved = max(moved, (value - initial[key]).abs().max().item())
    assert moved > 1e-2, "training did not move the parameters: the comparison would prove nothing"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddp_equals_single_process_on_the_union(trained, name):
    assert_same_training(trained, "ddp", name)


@pytest.mark.parametrize("name", FSDP_CONFIGS)
def test_fsdp_equals_single_process_on_the_union(trained, name):
    assert_same_training(trained, "fsdp", name)


def test_fsdp_units_inside_a_reversible_stack_are_refused(tmp_path):
    """Sharding each branch of a reversible stack once trained with silently wrong (lost)
    gradients of the branches; it must raise instead. One process is enough to see it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = make_model("reversible")
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model.transformer.layers.blocks[0][0], mesh=mesh)
        with pytest.raises(TypeError, match="cannot hold FSDP units"):
            loss_of(model, batch(0, 0))
        with torch.no_grad():  # nothing is recomputed without gradients: allowed
            assert torch.isfinite(loss_of(model, batch(0, 0)))
        del model
    finally:
        gc.collect()  # the FSDP unit's cycles go while the group is alive (see the module docstring)
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker_main(sys.argv[2:5])


def torch_python_state():
    """What of torch's thread-local state can hold Python objects that a collective started
    now would carry to gloo's thread: modes, default saved-tensor hooks, a graph-exec group."""
    return (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(False), torch._C._get_graph_exec_group())


@pytest.mark.parametrize("name, options", [*CONFIGS.items(), ("checkpoint", dict(checkpoint=True))])
def test_the_library_puts_no_python_object_where_ddp_starts_its_collectives(name, options):
    """DDP starts its all-reduces from hooks on the gradients' accumulation, and each carries
    the thread-local state of that moment to gloo's thread (docs/scale.md, "Ending a run"):
    the library's forward and backward leave nothing of theirs there."""
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**BASE, **options)
    seen = []
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda p: seen.append(torch_python_state()))
    loss_of(model, batch(0, 0)).backward()
    assert len(seen) == len(list(model.parameters()))
    assert set(seen) == {(0, 0, None, None)}
