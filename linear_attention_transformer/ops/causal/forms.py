"""How the torch kernel runs: its form, decided in one place, ``pick_form``.

A layer's ``kernel`` (``ops/kernels.py``) chooses between this library's chunked kernel
('torch') and flash-linear-attention's ('fla'); ``pick_form`` makes that choice for the
global heads, then, where the torch kernel runs, chooses its form. Every form computes the same
thing (each is tested against ``naive.py`` in float64); they differ in two choices, which a
``Form`` names:

* ``scan``: the algorithm that carries the state across the chunks (``scan.py``'s
  ``algorithm``): a Python ``loop`` over them, the work-efficient ``log_depth`` scan
  (launches grow as log n, not n), or the ``blocked`` scan (blocks of chunks: a graph whose
  size does not depend on n); ``fla`` where fla's kernels run instead;
* ``exact_chunks``: exponential-feature chunks exact by construction (``chunk.py``,
  ``_exact_chunk_factors``: no recompute, nothing read back to the host), or the fast
  chunks whose rare lost chunks are found and recomputed (one host sync per call eagerly,
  a ``torch.cond`` compiled).

===========  ==================  =========  ============  =========================================
form         where               scan       exact chunks  why
===========  ==================  =========  ============  =========================================
None         CPU, eager          loop       no            the CPU's fastest: exact chunks cost
                                                          several times the fast ones plus their
                                                          recompute (bench_kernel --forms,
                                                          benchmarks/README.md); a loop costs a
                                                          CPU nothing
None         any other device    log_depth  yes           no host sync in forward or backward
                                                          (segments included), launches ~ log n
sequential   anywhere, eager     loop       no            the CPU's form, on any device
parallel     anywhere, eager     log_depth  yes           the accelerators' form, on any device
compiled     anywhere, eager     blocked    no            what torch.compile traces on the CPU,
                                                          run eagerly
any          torch.compile       blocked    as above      the loop would unroll (a graph ~ n, a
                                                          recompile per chunk count under dynamic
                                                          shapes); the log-depth scan branches on
                                                          the chunk count
===========  ==================  =========  ============  =========================================

Exact chunks only exist for exponential features outside the blindspot form: given
features never underflow, and blindspot chunks hold no pairs inside a chunk. The chunk
length (``chunk``) is the blindspot block with ``blindspot_size`` > 1; chunks of
``PER_FEATURE_CHUNK`` (16, formed pair by pair in sub-chunks of 4) for a per-feature decay of
given features and for exact chunks (on the CPU less than half the time of chunks of 64);
else the caller's ``chunk_size``.

A form is named per call (``causal_linear_attention(..., form=...)``) or for a scope of code
that calls the kernel deep inside a model (``use_form``, which benchmarks and tests use to
trace a whole model in one form); None leaves it to the device. It acts wherever the torch
kernel runs and is refused beside ``kernel='fla'``. Adding a form is one entry in ``FORMS``
and one row above.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch

from ..kernels import check_kernel
from .fla import KERNEL_DTYPES, fla_missing, warn_unavailable

__all__ = ["Form", "FORMS", "FORM_NAMES", "check_form", "device_form", "pick_form", "reads_back", "reads_back_here",
           "scoped_form", "use_form"]

CHUNK_SIZE = 64  # the default chunk length (a layer's chunk_size), written here once
PER_FEATURE_CHUNK = 16


class Form(NamedTuple):
    """How ``causal_linear_attention`` computes (see the module docstring)."""

    scan: str  # ``scan.py``'s algorithm: "loop", "log_depth" or "blocked"; "fla": fla's own kernels (``fla.py``)
    exact_chunks: bool
    chunk: int = 0  # the chunk length (0 in ``FORMS``: set by ``pick_form``)


FORMS = {
    "sequential": Form("loop", False),
    "parallel": Form("log_depth", True),
    "compiled": Form("blocked", False),
}
FORM_NAMES = tuple(FORMS)
FLA = Form("fla", False, 64)  # kernel='fla': fla's kernels carry the state, exact by their own factors (fla.py)

_SCOPED = contextvars.ContextVar("causal_linear_attention_form", default=None)


def check_form(form):
    """``form`` if it is None or names a form, else a ValueError naming the choices (and, for
    the name of a scan, the form that runs it)."""
    if form is not None and (not isinstance(form, str) or form not in FORMS):
        runs_it = [name for name, known in FORMS.items() if known.scan == form] if isinstance(form, str) else []
        hint = f": {form!r} is a scan, which form={runs_it[0]!r} runs" if runs_it else ""
        raise ValueError(f"form must be None or one of {', '.join(map(repr, FORM_NAMES))}, got {form!r}{hint}")
    return form


@contextlib.contextmanager
def use_form(form):
    """Inside the ``with`` block, the torch kernel's calls that name no form run in ``form``
    (one of ``FORM_NAMES``, or None: by the device); the previous scope is restored on exit.
    Scoped to the thread / task (a ``contextvars`` variable). Under torch.compile it is read
    when the graph is traced: a graph keeps the form of the scope it was traced in."""
    token = _SCOPED.set(check_form(form))
    try:
        yield form
    finally:
        _SCOPED.reset(token)


@torch.compiler.assume_constant_result  # (dynamo cannot trace ContextVar.get)
def scoped_form():
    """The form that ``use_form`` set around this call (None outside any)."""
    return _SCOPED.get()


def device_form(device) -> str:
    """The form that None names on ``device`` (the table's first two rows)."""
    return "sequential" if device.type == "cpu" else "parallel"


def pick_form(device, compiling=False, kernel="auto", form=None, exp_features=False, blindspot_size=1,
              per_feature_decay=False, chunk_size=CHUNK_SIZE, dtype=torch.float32, gated_backward=False) -> Form:
    """The ``Form`` that runs a call on ``device``, inside torch.compile's trace or not
    (``compiling``), for a layer's ``kernel`` (docs/kernels.md's table) and, where the torch
    kernel runs, ``form`` (the module docstring's table), with these options and compute
    ``dtype`` (fla's kernels are float32). ``gated_backward``: given features with a per-head
    decay, needing gradients (a known-bad pair of fla and Triton affects it:
    ``fla.known_bad_pair``). Where 'auto' on CUDA cannot use fla for a reason of the machine
    (``fla.fla_unavailable``) it warns once per reason."""
    check_kernel(kernel)
    form = check_form(form)
    if kernel == "fla" or (kernel == "auto" and device.type == "cuda" and torch.cuda.is_available()):
        why_not = fla_missing(device, dtype, gated_backward)
        if why_not is None:
            return FLA
        if kernel == "fla":
            raise ValueError(f"kernel='fla' cannot run this call: {why_not}")
        if dtype in KERNEL_DTYPES:  # (float64 is the caller's choice, not the machine's: no warning)
            warn_unavailable(why_not)
    chosen = FORMS[form or device_form(device)]
    if compiling:
        chosen = chosen._replace(scan="blocked")
    exact = chosen.exact_chunks and exp_features and blindspot_size == 1
    if blindspot_size > 1:
        chunk = blindspot_size
    elif (per_feature_decay and not exp_features) or exact:
        chunk = min(chunk_size, PER_FEATURE_CHUNK)
    else:
        chunk = chunk_size
    return chosen._replace(exact_chunks=exact, chunk=chunk)


def reads_back_here(device) -> bool:
    """Whether code on ``device`` may read a value back to the host at no cost: eagerly, where
    the torch kernel's form in scope (else the device's) is the loop, which waits on the host
    anyway. The local heads ask it too, so that a scope such as ``use_form('parallel')`` makes
    a whole model run as an accelerator runs it."""
    return not torch.compiler.is_compiling() and (scoped_form() or device_form(device)) == "sequential"


def reads_back(form: Form) -> bool:
    """Whether ``form`` may wait on the host (its loop over chunks does, eagerly), so that a rare
    case is best ruled out by one value read back (``non_finite.quarantine``)."""
    return form.scan == "loop"
