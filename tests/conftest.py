"""Fixtures shared by the model-level tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Modules of many small models gain nothing from intra-op threads and, on a busy
    machine, wait for them: use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
