"""CommunicationCounter on 2 gloo processes: every collective of DDP and FSDP2 training, counted."""

from __future__ import annotations

import pytest

from fira_train.run.communication import CommunicationCounter
from fira_train.run.parallel import current_env, parallelize, shard_batch
from tests.fira_train.tiny_lm import build_model, global_batch, loss_fn, make_optimizer
from tests.multiprocess import run_ranks


def _counting_worker(rank: int, world: int, mode: str) -> dict:
    env = current_env()
    model = parallelize(build_model(), mode, env)
    counter = CommunicationCounter()
    if mode == "ddp":
        counter.watch_ddp(model)
    optimizer = make_optimizer(model, "fira")
    steps = []
    with counter:
        for step in range(2):  # step 0 refreshes, step 1 is ordinary
            counter.reset()
            loss_fn(model, shard_batch(global_batch(step), env)).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append(dict(counter.bytes))
    return {"steps": steps, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_communication_counter_sees_every_collective(tmp_path, mode):
    """DDP: the gradient buckets carry every gradient once and Fira adds nothing on ordinary
    steps. FSDP2: parameters all-gathered in forward and backward, gradients reduce-scattered,
    plus Fira's small reductions (left R + column norms + flags, right norms)."""
    result = run_ranks(_counting_worker, 2, tmp_path, mode, timeout=50)[0]
    ordinary = result["steps"][1]
    if mode == "ddp":
        assert ordinary == {"ddp_all_reduce": result["param_bytes"]}
        return
    # FSDP2 pads every parameter to an even number of rows (float64: 8 bytes an element).
    model = build_model()
    padded = {n: 8 * (-(-p.shape[0] // 2) * 2) * p[0].numel() for n, p in model.named_parameters()}
    assert ordinary["reduce_scatter_single"] == sum(padded.values())
    # Every parameter is gathered in forward and again in backward (reshard_after_forward).
    assert ordinary["all_gather_single"] == 2 * sum(padded.values())
    # Fira: left (down, 6 x 9): R (2 x 9) + 9 column norms; right (up, head): two norms each
    # (||S|| and ||phi G||, the check of its precision); one finiteness flag per gradient (10 parameters).
    assert ordinary["all_reduce"] == 8 * (2 * (2 * 9 + 9) + 2 * 3 + 10)
    refresh = result["steps"][0]
    assert refresh["gather"] > 0 and refresh["broadcast"] > 0
