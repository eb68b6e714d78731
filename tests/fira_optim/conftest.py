"""Shared set-up of the optimizer tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """Run the optimizer tests single-threaded.

    Their matrices are tiny (tens of rows): a second thread buys nothing, and on a busy
    2-core machine the MKL/OpenMP hand-off after each small SVD made a 20 x 12 matmul take
    ~30 ms instead of microseconds (the whole suite ran ~10x slower).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
