"""One thread for the algorithm tests: their tensors are too small to gain from threads,
and on a busy machine threads only wait for each other."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
