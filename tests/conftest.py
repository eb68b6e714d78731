"""Set-up shared by every test."""

import signal

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Run the tests single-threaded.

    Their models and matrices are tiny: a second thread buys nothing, and on a busy 2-core
    machine the MKL/OpenMP hand-off after each small SVD made a 20 x 12 matmul take ~30 ms
    instead of microseconds (the optimizer suite ran ~10x slower).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Started with SIGINT ignored (a shell's background job, `cmd &` outside job control), the session
# and every command-line process its tests start would ignore Ctrl-C, and the tests of what Ctrl-C
# does fail for the launch, not the code: Python's own handler, which its child processes replace
# with the default on exec, so that they install theirs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_handled():
    """Ctrl-C stops the test session again after a test that ran the command line's Ctrl-C path
    in this process: ``fira_train.cli.main`` ignores SIGINT from there on, for the process's exit."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    if handler is not None:  # None: not set from Python
        signal.signal(signal.SIGINT, handler)
