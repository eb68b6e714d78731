"""The multi-process test helper: a failed rendezvous is started afresh, a failure of the
function under test is reported at once with every failed rank's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.multiprocess import init_gloo, run_ranks


def _flaky_init(rank: int, world_size: int, store: str) -> None:
    """Every rank's first rendezvous fails, as gloo's does when a peer drops the connection."""
    marker = Path(store).parent / f"init-failed-{rank}"
    if not marker.exists():
        marker.touch()
        raise RuntimeError("Gloo connectFullMesh failed ... Connection closed by peer (simulated)")
    init_gloo(rank, world_size, store)


def _never_init(rank: int, world_size: int, store: str) -> None:
    raise RuntimeError(f"rendezvous refused for rank {rank} (simulated)")


def _sum_of_ranks(rank: int, world: int) -> int:
    import torch

    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t.item())


def _count_calls_then_fail(rank: int, world: int, workdir: str) -> None:
    calls = Path(workdir) / f"calls-{rank}"
    calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
    raise ValueError(f"wrong answer on rank {rank}")


def test_a_failed_rendezvous_is_started_afresh(tmp_path):
    assert run_ranks(_sum_of_ranks, 2, tmp_path, init=_flaky_init, timeout=50) == [1, 1]
    assert sorted(p.name for p in tmp_path.glob("init-failed-*")) == ["init-failed-0", "init-failed-1"]


def test_a_rendezvous_that_keeps_failing_is_reported_with_the_attempts(tmp_path):
    with pytest.raises(AssertionError) as error:
        run_ranks(_sum_of_ranks, 2, tmp_path, init=_never_init, attempts=2, timeout=50)
    message = str(error.value)
    assert "rank 0 failed (after 2 rendezvous attempts)" in message
    assert "rendezvous refused for rank 1" in message


def test_a_failure_inside_the_function_is_not_retried_and_names_every_rank(tmp_path):
    with pytest.raises(AssertionError) as error:
        run_ranks(_count_calls_then_fail, 2, tmp_path, str(tmp_path), timeout=50)
    message = str(error.value)
    assert "wrong answer on rank 0" in message and "wrong answer on rank 1" in message
    assert [(tmp_path / f"calls-{r}").read_text() for r in range(2)] == ["1", "1"]
