"""The paper's other baselines under ``train.parallel=ddp``: 2 gloo processes train like one process,
and a run stopped after its (DCP) checkpoint resumes as if never stopped (APOLLO's projectors
included). FSDP2 is refused for them (tests/fira_train/methods/test_peers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fira_train.run.callbacks import TrainCallback
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import micro_config
from tests.multiprocess import run_ranks

METHODS = ("apollo", "flora", "slimadam")  # apollo-mini runs apollo's code at rank 1
STEPS, SAVE = 6, 3  # micro: T = 5, so the resumed steps cross a projection refresh


def _config(root: Path, method: str, mode: str, out: str):
    return micro_config(root, f"train.steps={STEPS}", f"train.save_every={SAVE}", "train.eval_every=0",
                        f"optim.method={method}", f"train.parallel={mode}", out=out)


class FinalParameters(TrainCallback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def after_step(self, step, model, optimizer, loss) -> None:
        if step == STEPS:
            self.params = {n: p.detach().clone() for n, p in model.named_parameters()}


class _Stop(Exception):
    pass


class StopBefore(TrainCallback):
    def before_step(self, step, model, optimizer, loss) -> None:
        if step == SAVE + 1:
            raise _Stop


def _worker(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out = {}
    for method in METHODS:
        straight = FinalParameters()
        train(_config(root, method, "ddp", f"{method}-ddp"), callbacks=[straight])
        config = _config(root, method, "ddp", f"{method}-stopped")
        try:
            train(config, callbacks=[StopBefore()])
        except _Stop:
            pass
        resumed = FinalParameters()
        train(config, resume="latest", callbacks=[resumed])
        out[method] = {"straight": straight.params, "resumed": resumed.params}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers-ddp")
    reference = {}
    for method in METHODS:
        final = FinalParameters()
        train(_config(root, method, "none", f"{method}-one"), callbacks=[final])
        reference[method] = final.params
    ranks = run_ranks(_worker, 2, root / "workers", str(root), timeout=300)
    return reference, ranks


@pytest.mark.parametrize("method", METHODS)
def test_ddp_equals_one_process_and_resumes_identically(runs, method: str) -> None:
    reference, ranks = runs
    for rank in ranks:
        straight, resumed = rank[method]["straight"], rank[method]["resumed"]
        assert straight.keys() == reference[method].keys()
        for name, value in reference[method].items():
            # the ranks add their halves of each batch in another order: float32 round-off
            torch.testing.assert_close(straight[name], value, rtol=1e-4, atol=1e-5, msg=name)
            assert torch.equal(resumed[name], straight[name]), name
