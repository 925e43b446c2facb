"""Train a byte-level language model on enwik8 (or any file, or a built-in corpus) and report bits per character.

    python examples/train_enwik8.py                      # small model, built-in corpus, a few minutes on a laptop CPU
    python examples/train_enwik8.py --data /path/to/enwik8 --dim 512 --depth 6 --seq-len 1024 --steps 100000
    torchrun --nproc_per_node 2 examples/train_enwik8.py --data /path/to/enwik8     # data-parallel (DDP)
    torchrun --nproc_per_node 4 examples/train_enwik8.py --context-parallel 2 --seq-len 8192   # 2 x 2

Without ``--data`` the script trains on a ~1 MB English corpus built from text every Python
installation has (``make_local_corpus.py``'s sources: license texts, the Python Language
Reference, IDLE's text files, standard-library docstrings), built once into a cache file
(``--corpus-cache``). With ``--data`` the file is read as raw bytes: every byte is a token
(vocabulary 0..255). A file of exactly 100,000,000 bytes (enwik8) is split 90M / 5M / 5M as
usual; any other file 90% / 5% / 5%, contiguously. ``--data`` may also be a ``.gz`` or a
single-member ``.zip`` (as enwik8 is distributed). Nothing is ever downloaded.

Variants (the gate-and-convolution experiment):

    baseline        standard linear attention
    conv_only       + depthwise local convolution on q, k, v      (use_local_conv=True)
    full_improved   + sigmoid forget/output gates and convolution  (use_gate=True, use_local_conv=True)
    gate_only       the gates without the convolution (an ablation) (use_gate=True)

Design choices of the improvements that can be varied: ``--gate-temperature`` and
``--gate-granularity`` (settings of ``use_gate``; the latter only where the installed package
has it), ``--conv-activation silu`` (SiLU after every ``LocalConv``, through forward hooks
installed here, as GLA's short convolution does), ``--gate-parts`` (keep only one of the gates).

Training shows a progress bar (loss, BPC, tokens/s), validates every ``--eval-every`` steps,
prints a sample from the cached generator every ``--sample-every`` steps and the test BPC at the
end. ``--save ckpt.pt`` writes a checkpoint every ``--save-every`` steps and at the end;
``--resume ckpt.pt`` continues exactly where it stopped (model, optimizer, learning-rate
schedule, step, the position in the batch order, the random state): the losses after resuming
are those of an uninterrupted run. A checkpoint is plain data (tensors, numbers, strings,
lists, dicts), read with ``torch.load(weights_only=True)``: a file holding any other object is
refused, since unpickling it could run code. ``--hf-save FOLDER`` also writes, at the end, a
Hugging Face checkpoint (``save_pretrained``: the model and ``byte_tokenizer()``) that
``AutoModelForCausalLM`` and ``AutoTokenizer.from_pretrained`` load once
``linear_attention_transformer.hf`` is imported (``pip install -e ".[hf]"``); ``evaluate.py``
scores one with lm-eval. ``--log run.json`` writes the history, ``--plot curve.png`` training
and validation BPC against steps (needs matplotlib, ``pip install -e ".[examples]"``).

``--context-parallel P`` (under ``torchrun --nproc_per_node N``, N a multiple of P) splits every
window over P processes (``context_parallel=group``, docs/scale.md): the N ranks form N / P
data-parallel groups of P consecutive ranks (ranks d P .. d P + P - 1 hold the P slices of data
group d's windows, made with ``dist.new_group``). Rank c of a group passes its n_local =
seq_len / P bytes and the one after them; its loss is its part of the window's loss. The
gradients are summed over every process (the parts of each window) and divided by the number
of data groups (the mean over their windows), which is what DDP would average; validation and
test run on the first group's P processes. The batches, losses and updates are those of one
process training on the same windows (``--batch-size`` per data group).

The loss is ``AutoregressiveWrapper``'s next-byte cross-entropy in nats; BPC = loss / ln 2.
Validation BPC is the mean over a fixed set of windows evenly spaced over the validation split
(the same windows at every evaluation and for every variant), so runs are comparable.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import pickle
import platform
import re
import statistics
import sys
import time
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

# Read once, when torch loads its OpenMP runtime, so set before the import: a thread that
# finishes its share of a parallel region early sleeps instead of spinning (GNU OpenMP spins
# by default). Where another process keeps a core busy, a spinning thread is charged the CPU
# time it spins, so the scheduler lets it run only in turn with that process, and each of a
# step's thousands of small parallel ops waits for its turn; a thread that sleeps between ops
# is run at once when it wakes (examples/README.md, "Threads on a busy machine"). The environment's own setting
# wins. Imported after torch (tests, notebooks) it could not act, so the environment (which
# subprocesses inherit) is left alone.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
OPENMP_SLEEPS = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM, LinearSelfAttention  # noqa: E402
from linear_attention_transformer.autoregressive import top_k  # noqa: E402
from linear_attention_transformer.gating import LocalConv  # noqa: E402

ENWIK8_BYTES = 100_000_000
ENWIK8_SPLIT = (90_000_000, 5_000_000, 5_000_000)
BUILTIN_CORPUS_BYTES = 1_000_000

VARIANTS = {
    "baseline": {"use_gate": False, "use_local_conv": False},
    "conv_only": {"use_gate": False, "use_local_conv": True},
    "full_improved": {"use_gate": True, "use_local_conv": True},
    "gate_only": {"use_gate": True, "use_local_conv": False},  # ablation, not one of the experiment's three
    # the reference: every head a local softmax head that sees the whole training context, that
    # is causal softmax attention in the same model (positions, feed-forward, norms)
    "softmax": {"use_gate": False, "use_local_conv": False},
    # the recommended configuration (docs/layers.md, "Recommended"), and the same without the gate
    "recommended": {"use_gate": True, "use_local_conv": True, "feature_map": "taylor", "dim_qk": 16},
    "taylor_conv": {"use_gate": False, "use_local_conv": True, "feature_map": "taylor", "dim_qk": 16},
    # delta-rule global heads (docs/layers.md, "Delta-rule heads"), gated and not
    "delta": {"use_gate": True, "use_local_conv": True, "update_rule": "delta"},
    "delta_plain": {"use_gate": False, "use_local_conv": True, "update_rule": "delta"},
    # delta with keys of 128: a state of about the recommended heads' size (153 Taylor features)
    "delta_qk128": {"use_gate": True, "use_local_conv": True, "update_rule": "delta", "dim_qk": 128},
}


# ------------------------------------------------------------------------------ data


def load_bytes(path):
    """The bytes of ``path`` as a uint8 tensor. ``.gz`` files are decompressed, and a
    ``.zip`` must hold exactly one member, which is read. Raises SystemExit with a clear
    message when the file is missing or empty (no download is ever attempted)."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(
            f"--data {path}: no such file. This script never downloads anything; pass a local "
            f"copy of enwik8 (e.g. from http://mattmahoney.net/dc/enwik8.zip, fetched by you) or "
            f"any text file, e.g. the corpus built by examples/make_local_corpus.py."
        )
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            raw = f.read()
    elif path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            members = [m for m in z.namelist() if not m.endswith("/")]
            if len(members) != 1:
                raise SystemExit(f"--data {path}: expected a zip with one file, found {len(members)}")
            raw = z.read(members[0])
    else:
        raw = path.read_bytes()
    if not raw:
        raise SystemExit(f"--data {path}: the file is empty")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def default_corpus_cache():
    """Where the built-in corpus is kept: $XDG_CACHE_HOME (or ~/.cache)/linear_attention_transformer/."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "linear_attention_transformer" / "local_corpus.txt"


def builtin_corpus(cache, max_bytes=BUILTIN_CORPUS_BYTES, say=print):
    """The path of the built-in corpus (``make_local_corpus.py``'s sources, shuffled with seed
    0), built into ``cache`` on first use and read from there afterwards."""
    cache = Path(cache)
    if cache.is_file() and cache.stat().st_size > 0:
        return cache
    from make_local_corpus import corpus_bytes  # beside this script

    say(f"building the built-in corpus into {cache} (once) ...")
    data = corpus_bytes(max_bytes, seed=0)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(cache.name + f".{os.getpid()}.part")
    partial.write_bytes(data)
    partial.replace(cache)  # atomic: a concurrent run never reads half a file
    return cache


def split_data(data):
    """(train, valid, test) slices: 90M / 5M / 5M for enwik8-sized data, else 90% / 5% / 5%."""
    n = data.numel()
    if n == ENWIK8_BYTES:
        n_train, n_valid, _ = ENWIK8_SPLIT
    else:
        n_train, n_valid = int(n * 0.90), int(n * 0.05)
    return data[:n_train], data[n_train:n_train + n_valid], data[n_train + n_valid:]


def sample_batch(split, batch_size, seq_len, generator):
    """(batch_size, seq_len + 1) random windows of ``split`` as int64, drawn with ``generator``
    (its own seed, so that every variant trained with the same seed sees the same batches)."""
    starts = torch.randint(0, split.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([split[s:s + seq_len + 1] for s in starts.tolist()]).long()


def fixed_batches(split, n_batches, batch_size, seq_len):
    """``n_batches`` batches of (batch_size, seq_len + 1) windows whose starts are evenly
    spaced over the whole split: a fixed evaluation set, the same for every run."""
    n_windows = n_batches * batch_size
    last_start = split.numel() - seq_len - 1
    if last_start < 0:
        raise SystemExit(f"the split has {split.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    starts = torch.linspace(0, last_start, n_windows).long().tolist()
    windows = torch.stack([split[s:s + seq_len + 1] for s in starts]).long()
    return list(windows.split(batch_size))


# ----------------------------------------------------------------------------- model


def apply_conv_activation(model, activation):
    """Apply ``activation`` ('silu') to the output of every ``LocalConv`` of ``model`` via a
    forward hook; 'none' does nothing. Returns the number of convolutions hooked.

    The library's convolution is linear (and starts as the identity); GLA follows its short
    convolution with SiLU. A hook changes only the output, so cached decoding (which calls the
    same module) sees the same function as training."""
    if activation == "none":
        return 0
    if activation != "silu":
        raise ValueError(f"unknown conv activation {activation!r}")
    convs = [m for m in model.modules() if isinstance(m, LocalConv)]
    if not convs:
        raise SystemExit("--conv-activation silu needs a variant with the local convolution "
                         "(conv_only or full_improved)")
    for conv in convs:
        conv.register_forward_hook(lambda module, inputs, output: F.silu(output))
    return len(convs)


def restrict_conv(model, tensors):
    """Keep the local convolution only on ``tensors`` (a subset of 'qkv', e.g. 'v'): the
    convolutions of the others are bypassed by forward hooks that return their input, so the
    package is unchanged. Returns the number of convolutions bypassed.

    A design probe: the library convolves q, k and v before the exponential feature map, so a
    convolved key or query enters exp() as a weighted sum of neighbours; on v alone the
    convolution mixes what is read, not how the neighbours are matched."""
    if tensors == "qkv":
        return 0
    layers = [m.local_conv for m in model.modules() if isinstance(getattr(m, "local_conv", None), torch.nn.ModuleList)]
    if not layers:
        raise SystemExit("--conv-on needs a variant with the local convolution (conv_only or full_improved)")
    bypassed = 0
    for convs in layers:
        for name, conv in zip("qkv", convs):
            if name not in tensors:
                conv.register_forward_hook(lambda module, inputs, output: inputs[0])
                bypassed += 1
    return bypassed


def keep_gate_parts(model, parts):
    """Ablation of the gate: 'forget' removes every output gate, 'output' every forget gate,
    'both' keeps them. The library builds both with use_gate=True and skips a gate that is
    None, so setting the attribute to None after construction removes it cleanly."""
    if parts == "both":
        return
    drop = {"forget": "output_gate", "output": "forget_gate"}[parts]
    layers = [m for m in model.modules() if isinstance(getattr(m, drop, None), torch.nn.Module)]
    if not layers:
        raise SystemExit("--gate-parts needs a gated variant (full_improved or gate_only)")
    for layer in layers:
        setattr(layer, drop, None)


def gate_granularity_supported():
    """Whether the installed package accepts ``gate_granularity`` (a setting of ``use_gate``,
    'feature' or 'head'): tried on a tiny layer, since older versions refuse the keyword."""
    try:
        LinearSelfAttention(dim=8, heads=1, causal=True, use_gate=True, gate_granularity="head")
    except (TypeError, ValueError):
        return False
    return True


def model_options(args):
    """The keywords of the causal byte-level ``LinearAttentionTransformerLM`` that ``args``
    describes (see ``build_parser``), apart from what hooks change after it is built
    (``--conv-activation``, ``--conv-on``, ``--gate-parts``)."""
    switches = VARIANTS[args.variant]
    extra = {}
    if switches["use_gate"]:
        extra.update(gate_temperature=args.gate_temperature, gate_rank=args.gate_rank)
        if args.gate_granularity != "default":
            if not gate_granularity_supported():
                raise SystemExit("--gate-granularity: the installed linear_attention_transformer has no "
                                 "gate_granularity option (use_gate's setting); leave it at 'default'")
            extra.update(gate_granularity=args.gate_granularity)
    elif args.gate_granularity != "default":
        raise SystemExit("--gate-granularity is a setting of the gate: it needs full_improved or gate_only")
    if switches["use_local_conv"]:
        extra.update(local_conv_kernel=args.local_conv_kernel)
    softmax = args.variant == "softmax"
    local_heads = args.heads if softmax else args.n_local_attn_heads
    # (a window also sees the one before it: half the context covers all of it)
    window = -(-args.seq_len // 2) if softmax else args.local_attn_window_size
    return dict(
        num_tokens=256,
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        dim_head=args.dim_head,
        max_seq_len=args.seq_len,
        causal=True,
        n_local_attn_heads=local_heads,
        # the window shapes the local heads and the axial table; without either it is refused
        local_attn_window_size=window if local_heads or args.pos_emb == "axial" else None,
        blindspot_size=args.blindspot_size,
        ff_glu=args.ff_glu,
        ff_dropout=args.dropout,
        attn_layer_dropout=args.dropout,
        attn_dropout=args.dropout,
        shift_tokens=args.shift_tokens,
        use_axial_pos_emb=args.pos_emb == "axial",
        use_rotary_emb=args.pos_emb == "rotary",
        use_pos_emb=args.pos_emb != "none",
        **switches,
        **extra,
    )


def build_model(args):
    """The ``AutoregressiveWrapper`` around a causal byte-level ``LinearAttentionTransformerLM``
    configured from ``args`` (see ``build_parser``)."""
    net = LinearAttentionTransformerLM(**model_options(args))
    apply_conv_activation(net, args.conv_activation)
    restrict_conv(net, args.conv_on)
    keep_gate_parts(net, args.gate_parts)
    return AutoregressiveWrapper(net)


# options whose effect hooks or edits after construction make: a config cannot describe them
HOOKED_OPTIONS = (("conv_activation", "none"), ("conv_on", "qkv"), ("gate_parts", "both"))


def check_hf_save(args):
    """Before the first step: ``--hf-save`` names a folder (made when missing) that can be written,
    ``transformers`` imports, and the model is one a config describes; else SystemExit naming
    the option."""
    folder = Path(args.hf_save)
    hooked = [f"--{key.replace('_', '-')} {getattr(args, key)}" for key, plain in HOOKED_OPTIONS
              if getattr(args, key) != plain]
    if hooked:
        raise SystemExit(f"--hf-save: {', '.join(hooked)} changes the model by hooks that a Hugging Face "
                         f"config cannot describe; leave it at its default to save one")
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"--hf-save {folder}: a file; name the folder to write the checkpoint into")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--hf-save {folder}: cannot make the folder ({e})") from None
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"--hf-save {folder}: not writable")
    try:
        import linear_attention_transformer.hf  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--hf-save needs linear_attention_transformer.hf and transformers ({e}): "
                         f"pip install -e \".[hf]\"") from None


def save_hf_checkpoint(net, args, folder):
    """``net`` (the ``LinearAttentionTransformerLM`` trained as ``args`` describes) and the byte
    tokenizer written into ``folder`` by ``save_pretrained``: ``AutoModelForCausalLM`` and
    ``AutoTokenizer.from_pretrained(folder)`` load them once ``linear_attention_transformer.hf``
    is imported."""
    from linear_attention_transformer.hf import (LinearAttentionTransformerConfig,
                                                 LinearAttentionTransformerForCausalLM, byte_tokenizer)

    model = LinearAttentionTransformerForCausalLM(LinearAttentionTransformerConfig(**model_options(args)))
    model.model.load_state_dict(net.state_dict())
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


# -------------------------------------------------------------------------- training


@dataclass
class ContextSplit:
    """Where this process sits in ``--context-parallel``: slice ``index`` of ``size`` slices of
    every window, the slices' processes forming ``group`` (a torch.distributed group)."""

    group: object
    index: int
    size: int

    def part(self, windows):
        """This process's part of (b, seq_len + 1) windows: its n_local = seq_len / size tokens
        and the one after them (what ``AutoregressiveWrapper`` takes with context_parallel)."""
        n_local = (windows.shape[1] - 1) // self.size
        return windows[:, self.index * n_local : (self.index + 1) * n_local + 1]


@torch.no_grad()
def evaluate(model, batches, device, split=None):
    """Mean next-byte loss (nats) over ``batches``; every batch has the same number of
    targets, so this is also the mean over all targets. The training mode is restored.
    ``split``: a ``ContextSplit``; every process of its group must call this with the same
    batches (each computes its part of each loss, summed over the group)."""
    was_training = model.training
    model.eval()
    if split is None:
        losses = [model(b.to(device), return_loss=True).item() for b in batches]
    else:
        import torch.distributed as dist

        parts = torch.stack([model(split.part(b).to(device), return_loss=True, context_parallel=split.group)
                             for b in batches]).double()
        dist.all_reduce(parts, group=split.group)
        losses = parts.tolist()
    model.train(was_training)
    return sum(losses) / len(losses)


def bpc(loss):
    """Bits per character (byte) from a cross-entropy in nats."""
    return loss / math.log(2)


def resolve_device(name):
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def usable_cores():
    """The CPU cores this process may run on (its affinity mask; all of them where the
    platform has no such mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(samples=10, interval=0.03, source="/proc/loadavg"):
    """How many cores other work keeps busy now: the mean number of runnable threads besides
    this one, from ``source``'s 'running/total' field (/proc/loadavg) sampled ``samples`` times. Off Linux,
    the 1-minute load average. Not the load average on Linux: it lags a minute behind, and
    right after a run of this script it still counts that run's own threads."""
    counts = []
    for i in range(samples):
        try:
            with open(source) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus the reading thread
        except (OSError, IndexError, ValueError):
            break
        if i + 1 < samples:
            time.sleep(interval)
    if counts:
        return sum(counts) / len(counts)
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested, openmp_sleeps=None):
    """(threads, why): ``--threads`` when given; torch's own count when OMP_NUM_THREADS is set
    (torchrun sets it for every process it starts); else the usable cores (at most torch's
    count, which leaves out hyper-threads' twins). Only where OpenMP's idle threads spin
    (``openmp_sleeps`` False; default: whether OMP_WAIT_POLICY=PASSIVE was in force when torch
    loaded) are the cores that other work keeps busy left out, at least 1 thread kept: a
    spinning thread that shares its core makes every small op of the step wait (see the top
    of this file), while a sleeping one does not, and gets a share of the busy core too."""
    if requested:
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    cores = usable_cores()
    most = min(cores, torch.get_num_threads())
    if OPENMP_SLEEPS if openmp_sleeps is None else openmp_sleeps:
        return most, f"{cores} usable cores, idle threads sleep (OMP_WAIT_POLICY=PASSIVE); --threads N overrides"
    busy = busy_cores()
    machine_cores = os.cpu_count() or cores
    free = cores - busy * cores / machine_cores  # other work spread over the machine's cores
    return max(1, min(most, int(free + 0.5))), (f"{cores} usable cores, {busy:.1f} busy with other work, idle "
                                                 f"threads spin; --threads N overrides")


def generate_sample(model, prime, length, device, temperature=1.0):
    """``length`` bytes sampled after ``prime`` (top 10% of bytes, then temperature),
    decoded as UTF-8 with replacement characters for invalid sequences."""
    out = model.generate(prime.long().to(device), length, temperature=temperature,
                         filter_logits_fn=top_k, filter_thres=0.9)
    return bytes(out.tolist()).decode("utf-8", errors="replace")


def warmup_factor(warmup_steps):
    """The learning-rate factor of step s (0-based): linear warmup over ``warmup_steps``, then 1."""
    return lambda s: (s + 1) / warmup_steps if warmup_steps and s < warmup_steps else 1.0


def setup_distributed(device):
    """(rank, world size, device). Under torchrun (WORLD_SIZE > 1) joins the process group
    (nccl on GPUs, gloo on the CPU) and gives every process its own GPU; else (0, 1, device)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def context_parallel_groups(rank, world, size):
    """``--context-parallel size``: (this process's ``ContextSplit``, its data-parallel group's
    index, the number of data groups). Consecutive ranks d * size .. d * size + size - 1 hold
    the slices of data group d; every process makes every group (``new_group`` is collective)."""
    if world % size:
        raise SystemExit(f"--context-parallel {size}: the {world} processes are not a multiple of it")
    import torch.distributed as dist

    groups = [dist.new_group(list(range(d * size, (d + 1) * size))) for d in range(world // size)]
    return ContextSplit(groups[rank // size], rank % size, size), rank // size, world // size


def sum_gradients(model, device, divide_by):
    """Every parameter's gradient summed over all processes, then divided by ``divide_by``: the
    whole windows' gradients (parts summed over each context-parallel group), averaged over the
    data groups. One all-reduce of all gradients at once (a parameter without one counts 0)."""
    import torch.distributed as dist

    params = list(model.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= divide_by
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def mean_over_processes(value, world, device):
    """``value`` averaged over the DDP processes (itself when there is one)."""
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world


def random_state(device):
    """Every random state a training step consumes (the batch order has its own generator)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_random_state(state, device):
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def plot_history(history, path, title):
    """Training and validation BPC against steps, as a PNG at ``path`` (matplotlib, imported here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(steps, [h["train_bpc"] for h in history], marker=".", label="training (mean since the last validation)")
    ax.plot(steps, [h["val_bpc"] for h in history], marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bpc (bits per character, i.e. byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "data_rng", "random", "progress", "config")


def load_checkpoint(path, device="cpu"):
    """The checkpoint ``--save`` wrote at ``path``, its tensors on ``device``. Loaded with
    ``torch.load(weights_only=True)``: a checkpoint is plain data (tensors, numbers, strings,
    lists, tuples and dicts), so loading one runs no code from the file. A file that holds any
    other object is refused (SystemExit naming the object) rather than unpickled, as is a file
    that is no checkpoint of this script."""
    if not Path(path).is_file():
        raise SystemExit(f"--resume {path}: no such checkpoint")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = found.group(1) if found else "an object torch's weights-only loader does not accept"
        raise SystemExit(f"--resume {path}: the checkpoint holds {what}, not only plain data (tensors, numbers, "
                         f"strings, lists and dicts, all that this script saves); unpickling it could run code "
                         f"from the file, so it is not loaded") from None
    except Exception as e:  # (the unpickler fails in many ways on a file torch.save did not write)
        raise SystemExit(f"--resume {path}: not a checkpoint written by torch.save "
                         f"({type(e).__name__}: {e})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise SystemExit(f"--resume {path}: not a checkpoint of this script (no {', '.join(missing)})")
    return ckpt


OUTPUTS = (("save", "checkpoint"), ("log", "JSON log"), ("plot", "plot"))
HF_OUTPUT = ("hf_save", "Hugging Face checkpoint")


def prepare_outputs(args):
    """Before the first step: every output file's folder exists (made when missing) and is
    writable, no output names a folder, and ``--plot``'s matplotlib imports; else SystemExit
    naming the option, rather than an error after training that loses the run's results."""
    for key, what in OUTPUTS:
        path = getattr(args, key)
        if not path:
            continue
        path = Path(path)
        if path.is_dir():
            raise SystemExit(f"--{key} {path}: a folder; name the {what} file to write")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"--{key} {path}: cannot make its folder ({e})") from None
        if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
            raise SystemExit(f"--{key} {path}: not writable")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(f"--plot {args.plot} needs matplotlib: pip install -e \".[examples]\"") from None


def train(args, quiet=False):
    """Train one model as ``args`` describes (see ``build_parser``); returns the run's log as a
    dict (also written to ``args.log`` when set). ``quiet`` hides the progress bar and messages."""
    threads, threads_reason = choose_threads(args.threads)
    torch.set_num_threads(threads)
    rank, world, device = setup_distributed(resolve_device(args.device))
    main_process = rank == 0
    split, data_rank, data_world = None, rank, world
    if args.context_parallel > 1:
        if world == 1:
            raise SystemExit("--context-parallel needs several processes: launch with torchrun --nproc_per_node N "
                             "(N a multiple of it)")
        if args.seq_len % args.context_parallel:
            raise SystemExit(f"--context-parallel {args.context_parallel}: --seq-len {args.seq_len} is not a "
                             f"multiple of it")
        split, data_rank, data_world = context_parallel_groups(rank, world, args.context_parallel)
    # who validates: the main process, or under context parallelism its whole group
    evaluates = main_process if split is None else data_rank == 0
    say = tqdm.write if main_process and not quiet else (lambda *a, **k: None)

    if main_process:
        prepare_outputs(args)
        if args.hf_save:
            check_hf_save(args)
    data_path = args.data or builtin_corpus(args.corpus_cache or default_corpus_cache(), say=say)
    data = load_bytes(data_path)
    train_split, valid_split, test_split = split_data(data)
    valid_batches = fixed_batches(valid_split, args.eval_batches, args.batch_size, args.seq_len)

    torch.manual_seed(args.seed)
    model = build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_factor(args.warmup_steps))
    data_rng = torch.Generator().manual_seed(args.seed)  # the batch order: the same for every variant
    progress = {"step": 0, "history": [], "train_losses": [], "step_times": []}
    if args.resume:
        ckpt = load_checkpoint(args.resume, device)
        differ = {k: (ckpt["config"].get(k), getattr(args, k)) for k in trajectory_keys()
                  if ckpt["config"].get(k) != getattr(args, k)}
        if differ:
            raise SystemExit(f"--resume {args.resume}: options differ from the checkpoint's run "
                             f"(checkpoint, now): {differ}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        data_rng.set_state(ckpt["data_rng"])
        set_random_state(ckpt["random"], device)
        progress = ckpt["progress"]
        if progress["step"] >= args.steps:
            raise SystemExit(f"--resume {args.resume}: the run is at step {progress['step']} already; "
                             f"pass a larger --steps to train on")
        outputs = ", ".join(f"{what} {getattr(args, key)}" for key, what in (*OUTPUTS, HF_OUTPUT)
                            if getattr(args, key))
        say(f"resuming from step {progress['step']} of {args.resume}, training to step {args.steps}; "
            f"writing {outputs or 'no files (no --save, --log, --plot or --hf-save)'}")
    train_model = model
    if split is not None:  # the same start everywhere (as DDP makes it): rank 0's parameters
        import torch.distributed as dist

        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    elif world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def save(path):
        partial = Path(f"{path}.{os.getpid()}.part")  # replaced at once: a crash never leaves half a file
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "data_rng": data_rng.get_state(),
                    "random": random_state(device), "progress": progress,
                    "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
                   partial)
        partial.replace(path)

    def show_sample(step):
        # its own seeded random state: sampling leaves the training's random state untouched
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(args.seed + step)
            text = generate_sample(model, valid_split[:args.prime_len], args.generate, device)
        say(f"--- sample after step {step} (prompt: the first {args.prime_len} bytes of the validation split) ---")
        say(bytes(valid_split[:args.prime_len].tolist()).decode("utf-8", errors="replace") + " ⟶ " + text)
        return text

    say(f"data {data_path}: {data.numel():,} bytes -> train {train_split.numel():,} / "
        f"valid {valid_split.numel():,} / test {test_split.numel():,}")
    say(f"variant {args.variant}, {n_params:,} parameters, device {device}, {threads} threads ({threads_reason})"
        + (f", {world} processes" if world > 1 else "")
        + (f" ({data_world} data-parallel x {split.size} context-parallel)" if split is not None else "")
        + (", bf16 autocast" if args.bf16 else ""))
    tokens_per_step = args.batch_size * args.grad_accum * data_world * args.seq_len
    history, train_losses, step_times = progress["history"], progress["train_losses"], progress["step_times"]
    bar = tqdm(total=args.steps, initial=progress["step"], unit="step", dynamic_ncols=True,
               disable=quiet or not main_process, mininterval=0.5)
    start, sample = time.perf_counter(), None
    for step in range(progress["step"] + 1, args.steps + 1):
        t0 = time.perf_counter()
        windows = sample_batch(train_split, args.batch_size * args.grad_accum * data_world, args.seq_len, data_rng)
        micro_batches = windows.split(args.batch_size)[data_rank::data_world]  # this (data group's) share
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = nullcontext() if last or world == 1 or split is not None else train_model.no_sync()
            with sync, autocast:
                if split is None:
                    loss = train_model(micro.to(device), return_loss=True)
                else:  # this process's part of the windows' loss
                    loss = train_model(split.part(micro).to(device), return_loss=True, context_parallel=split.group)
            (loss / args.grad_accum).backward()
            loss_sum += loss.item()
        if split is not None:
            sum_gradients(model, device, data_world)
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        # under context parallelism the processes hold parts: sum each group's, mean over groups
        loss_value = mean_over_processes(loss_sum / args.grad_accum, world, device)
        if split is not None:
            loss_value *= split.size
        step_times.append(time.perf_counter() - t0)
        train_losses.append(loss_value)
        progress["step"] = step
        if not math.isfinite(loss_value):
            raise SystemExit(f"step {step}: the training loss is {loss_value}")
        bar.update(1)
        bar.set_postfix({"loss": f"{loss_value:.3f}", "bpc": f"{bpc(loss_value):.3f}",
                         "tokens/s": f"{tokens_per_step / step_times[-1]:,.0f}"}, refresh=False)

        out_of_time = bool(args.max_minutes) and sum(step_times) > 60 * args.max_minutes
        if world > 1 and args.max_minutes:  # every process stops at the same step (their clocks differ)
            import torch.distributed as dist

            flag = torch.tensor([float(out_of_time)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            out_of_time = bool(flag.item())
        final = step == args.steps or out_of_time
        if evaluates and (step % args.eval_every == 0 or final):
            with autocast:
                val_loss = evaluate(model, valid_batches, device, split)
        if main_process and (step % args.eval_every == 0 or final):
            recent = train_losses[-(step - (history[-1]["step"] if history else 0)):]
            train_loss = sum(recent) / len(recent)
            history.append({"step": step, "train_loss": train_loss, "train_bpc": bpc(train_loss),
                            "val_loss": val_loss, "val_bpc": bpc(val_loss), "elapsed_s": sum(step_times)})
            say(f"step {step:6d}  train {bpc(train_loss):.4f} bpc  valid {bpc(val_loss):.4f} bpc")
        if main_process and args.generate and args.sample_every and (step % args.sample_every == 0 or final):
            sample = show_sample(step)
        if main_process and args.save and (final or (args.save_every and step % args.save_every == 0)):
            save(args.save)
        if out_of_time:
            say(f"stopping after step {step}: --max-minutes {args.max_minutes} reached")
            break
    bar.close()
    test_loss = None
    if evaluates and args.test_batches:
        with autocast:
            test_loss = evaluate(model, fixed_batches(test_split, args.test_batches, args.batch_size, args.seq_len),
                                 device, split)
    if not main_process:
        return None
    if args.hf_save:
        save_hf_checkpoint(model.net, args, args.hf_save)
        say(f"Hugging Face checkpoint written to {args.hf_save}")

    skip = min(args.timing_warmup, max(len(step_times) - 1, 0))
    timed = step_times[skip:] or [float("nan")]
    log = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "device": str(device), "processes": world,
                    "context_parallel": 1 if split is None else split.size,
                    "threads": threads, "threads_reason": threads_reason, "cpu_count": os.cpu_count(),
                    "usable_cores": usable_cores(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                    "load_average_at_end": os.getloadavg()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": str(data_path),
        "n_params": n_params,
        "n_bytes": {"train": train_split.numel(), "valid": valid_split.numel(), "test": test_split.numel()},
        "valid_windows": args.eval_batches * args.batch_size,
        "steps_done": progress["step"],
        "history": history,
        "train_losses": train_losses,
        "final_val_loss": history[-1]["val_loss"] if history else None,
        "final_val_bpc": history[-1]["val_bpc"] if history else None,
        "mean_step_s": statistics.fmean(timed),
        "median_step_s": statistics.median(timed),
        "train_time_s": sum(step_times),
        "total_time_s": time.perf_counter() - start,
    }
    if test_loss is not None:
        log.update(final_test_loss=test_loss, final_test_bpc=bpc(test_loss))
        say(f"test {bpc(test_loss):.4f} bpc ({args.test_batches * args.batch_size} windows of the test split)")
    if history:
        say(f"final valid {log['final_val_bpc']:.4f} bpc; {log['median_step_s'] * 1000:.0f} ms/step "
            f"(median after {skip} warm-up steps); {log['train_time_s']:.0f} s of training")
    if sample is not None:
        log["sample"] = {"prime": bytes(valid_split[:args.prime_len].tolist()).decode("utf-8", errors="replace"),
                         "generated": sample}
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps(log, indent=2))
        say(f"log written to {args.log}")
    if args.plot and history:
        plot_history(history, args.plot, f"{args.variant}, {n_params:,} parameters")
        say(f"plot written to {args.plot}")
    return log


# ----------------------------------------------------------------------------- CLI


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default once: appended as '(default: ...)' unless the help text
    gives it itself ('(default: ...)' in its words), the default is None (the help says what
    happens without the option) or the option is a flag (off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def build_parser():
    """The command-line options (also used by compare_variants.py and compare_improvements.py)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None,
                   help="enwik8 (raw, .gz or .zip) or any file, read as bytes (default: the built-in corpus)")
    d.add_argument("--corpus-cache", default=None,
                   help=f"where the built-in corpus is built (default: {default_corpus_cache()})")

    t = p.add_argument_group("training")
    t.add_argument("--variant", choices=sorted(VARIANTS), default="full_improved",
                   help="baseline: plain linear attention; conv_only: + local convolution on q, k, v; "
                        "full_improved: + forget/output gates and the convolution; gate_only: the gates alone; "
                        "softmax: every head softmax attention over the whole context (the reference); "
                        "recommended: the gates, the convolution and Taylor features of 16-wide queries and keys; "
                        "taylor_conv: the same without the gates; delta: the gates, the convolution and "
                        "delta-rule global heads; delta_plain: the same without the gates; delta_qk128: delta with "
                        "queries and keys of 128")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument("--max-minutes", type=float, default=0.0, help="stop once training took this long (0: no limit)")
    t.add_argument("--batch-size", type=int, default=8, help="windows per micro-batch and process")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    t.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warmup")
    t.add_argument("--grad-clip", type=float, default=0.5, help="max gradient norm (0: off)")
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    t.add_argument("--seed", type=int, default=0, help="seeds both the initialisation and the batch order")
    t.add_argument("--context-parallel", type=int, default=1, metavar="P",
                   help="split every window over P processes (under torchrun, N a multiple of P; 1: off)")
    t.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', ...")
    t.add_argument("--threads", type=int, default=0,
                   help="CPU threads (torch.set_num_threads). 0 chooses: the cores this process may use "
                        "(its affinity); where OpenMP's idle threads spin (OMP_WAIT_POLICY other than PASSIVE, "
                        "which this script sets) less those other processes keep busy, at least 1; under "
                        "OMP_NUM_THREADS (torchrun sets it) torch's count. The choice and why are printed")
    t.add_argument("--save", default=None, help="checkpoint file, written every --save-every steps and at the end")
    t.add_argument("--save-every", type=int, default=500, help="checkpoint interval in steps (0: only at the end)")
    t.add_argument("--hf-save", default=None, metavar="FOLDER",
                   help="at the end, also write a Hugging Face checkpoint here (save_pretrained: the model and "
                        "the byte tokenizer), which AutoModelForCausalLM.from_pretrained loads; needs the hf extra")
    t.add_argument("--resume", default=None,
                   help="continue the run of this checkpoint: its options and outputs (--save, --log, --plot, "
                        "the reporting) unless given again; --steps must grow")

    r = p.add_argument_group("reporting")
    r.add_argument("--eval-every", type=int, default=100, help="validate every N steps (and at the end)")
    r.add_argument("--eval-batches", type=int, default=16, help="fixed validation batches per evaluation")
    r.add_argument("--test-batches", type=int, default=16, help="test batches at the end (0: no test BPC)")
    r.add_argument("--generate", type=int, default=200, help="bytes per sample (0: no samples)")
    r.add_argument("--sample-every", type=int, default=500, help="sample every N steps (and at the end)")
    r.add_argument("--prime-len", type=int, default=64, help="bytes of the validation split used as prompt")
    r.add_argument("--timing-warmup", type=int, default=5, help="steps left out of the time per step")
    r.add_argument("--log", "--json-log", dest="log", default=None,
                   help="write a JSON log of the run here (under torchrun spell it --json-log: torchrun "
                        "takes --log for an abbreviation of its own --log-dir)")
    r.add_argument("--plot", default=None, help="write training/validation BPC against steps here (PNG)")

    m = p.add_argument_group("model")
    m.add_argument("--dim", type=int, default=128, help="model width")
    m.add_argument("--depth", type=int, default=2, help="transformer layers")
    m.add_argument("--heads", type=int, default=4, help="attention heads per layer (linear and local)")
    m.add_argument("--dim-head", type=int, default=None, help="head width (default: dim / heads)")
    m.add_argument("--seq-len", type=int, default=256, help="training context (also max_seq_len)")
    m.add_argument("--n-local-attn-heads", type=int, default=2, help="softmax heads in a sliding window; the rest are linear")
    m.add_argument("--local-attn-window-size", type=int, default=64,
                   help="window of the local softmax heads (and the axial positions' row length)")
    m.add_argument("--blindspot-size", type=int, default=1, help="1: the linear heads see every earlier token")
    m.add_argument("--pos-emb", choices=("absolute", "axial", "rotary", "none"), default="rotary",
                   help="position information: learned absolute embedding, axial, rotary, or none (the gates, the "
                        "convolution and the local heads carry order)")
    m.add_argument("--ff-glu", action="store_true", help="GLU feed-forward")
    m.add_argument("--shift-tokens", action="store_true", help="token shifting in every branch")
    m.add_argument("--dropout", type=float, default=0.0, help="feed-forward and attention dropout")
    m.add_argument("--gate-temperature", type=float, default=16.0, help="tau of the forget gate (gated variants)")
    m.add_argument("--gate-rank", type=int, default=16, help="rank of the forget gate's projection")
    m.add_argument("--gate-granularity", choices=("default", "feature", "head"), default="default",
                   help="forget gate per key feature or per head (default: the library's own; the option only "
                        "where the installed package has it)")
    m.add_argument("--gate-parts", choices=("both", "forget", "output"), default="both",
                   help="ablation: keep only the forget gate or only the output gate")
    m.add_argument("--local-conv-kernel", type=int, default=3, help="taps of the local convolution")
    m.add_argument("--conv-on", choices=("qkv", "kv", "v"), default="qkv",
                   help="which of q, k, v the local convolution acts on (kv, v: the others bypassed by hooks)")
    m.add_argument("--conv-activation", choices=("none", "silu"), default="none",
                   help="activation after the local convolution (implemented here by forward hooks)")
    return p


def options_from_pairs(pairs):
    """Command-line arguments of this script from OPTION=VALUE strings (``dim=256``,
    ``ff_glu=true`` for a flag), as comparison scripts take them."""
    argv = []
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected OPTION=VALUE, got {item!r}")
        argv.append(f"--{key.replace('_', '-')}")
        if value.lower() not in ("true", ""):  # bare flags (store_true) take no value
            argv.append(value)
    return argv


# the options that describe this invocation and the machine, not the run: a resumed run takes
# these as given now (or their defaults), every other one from its checkpoint
INVOCATION_KEYS = ("steps", "max_minutes", "resume", "device", "threads", "context_parallel", "corpus_cache")


def trajectory_keys():
    """The options a resumed run must share with the checkpoint's: everything that decides
    the model, the data, the batches and the updates (not --steps, not the reporting)."""
    parser = build_parser()
    groups = {g.title: g for g in parser._action_groups}
    model = [a.dest for a in groups["model"]._group_actions]
    return ["data", "variant", "batch_size", "grad_accum", "lr", "warmup_steps", "grad_clip", "bf16", "seed", *model]


def explicit_options(argv):
    """The destinations of the options given on the command line ``argv``."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.seq_len < 2 or args.steps < 1 or args.batch_size < 1 or args.eval_every < 1 or args.grad_accum < 1 \
            or args.context_parallel < 1 or args.threads < 0:
        raise SystemExit("--seq-len must be >= 2, --steps, --batch-size, --grad-accum, --eval-every, "
                         "--context-parallel >= 1 and --threads >= 0 (0: chosen)")
    if args.resume:  # the run's options and outputs from the checkpoint, unless given again
        saved = load_checkpoint(args.resume)["config"]
        given = explicit_options(argv)
        for key in vars(args):
            if key not in given and key not in INVOCATION_KEYS and key in saved:
                setattr(args, key, saved[key])  # a trajectory option given again must agree (train checks)
    train(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        # as tests/test_distributed.py's workers end: no process shuts its connections while
        # another still reads, and nothing holds gloo's state once the group is destroyed
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # leave without interpreter finalization, where gloo's threads can abort the process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
