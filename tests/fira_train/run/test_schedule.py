"""The warm-up + cosine schedule (and ReLoRA's jagged variant)."""

from __future__ import annotations

import math

import pytest
import torch

from fira_train.run.schedule import WarmupCosine, restart_rewarmup, warmup_cosine


def test_warmup_then_cosine_to_ten_percent() -> None:
    total, warmup = 1000, 100
    f = [warmup_cosine(s, total, warmup, 0.1) for s in range(total)]
    assert f[0] == pytest.approx(1 / warmup)
    assert f[warmup - 1] == pytest.approx(1.0)
    assert f[warmup] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:warmup], f[1:warmup]))          # rising
    assert all(a >= b for a, b in zip(f[warmup:], f[warmup + 1:]))      # falling
    assert f[-1] == pytest.approx(0.1, abs=1e-4)
    middle = warmup + (total - warmup) // 2
    assert f[middle] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), abs=1e-3)


def test_no_warmup() -> None:
    assert warmup_cosine(0, 10, 0, 0.1) == pytest.approx(1.0)


def test_restart_rewarmup_is_jagged() -> None:
    factors = [restart_rewarmup(s, cycle=10, rewarmup=4) for s in range(25)]
    assert factors[:10] == [1.0] * 10  # no re-warm-up before the first restart
    assert factors[10:15] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert factors[20] == pytest.approx(0.25)


def test_lambda_lr_state_round_trips_with_weights_only(tmp_path) -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(20, 0.1, 0.1, restart_every=8, rewarmup=2))
    for _ in range(5):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    opt2 = torch.optim.SGD([param], lr=0.5)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, WarmupCosine(20, 0.1, 0.1, restart_every=8, rewarmup=2))
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    for _ in range(6):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
