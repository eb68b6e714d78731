"""Metric logs, optimizer-state size, peak memory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import fira_optim
from fira_optim import optimizer_state_numel
from fira_optim.state import optimizer_state_bytes
from fira_train.run.metrics import MetricsLog, perplexity, read_metrics
from fira_train.run.peak_memory import PeakMemory


def test_jsonl_lines_and_resume_truncation(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log({"step": step, "loss": 1.0 / step, "lr": 0.1, "tokens_per_s": 100.0})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[2])["step"] == 3
    # a run killed after step 5 but checkpointed at step 3 resumes from 3: steps 4, 5 are dropped
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    log.log({"step": 4, "loss": 9.0, "lr": 0.1, "tokens_per_s": 100.0})
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["loss"] == 9.0
    # killed while writing step 5's line (after checkpoint 4): the cut line goes, it was refused
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "lo')
    MetricsLog(tmp_path, tensorboard=False, resume_step=4).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_tensorboard_events_are_written(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=True)
    log.log({"step": 1, "loss": 2.0, "lr": 0.1, "tokens_per_s": 10.0, "val_ppl": float("inf")})
    log.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_optimizer_state_size_of_adamw_is_two_moments() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_state_numel(opt) == 0  # state is created by the first step
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert optimizer_state_numel(opt) == 2 * n  # step counters excluded
    assert optimizer_state_bytes(opt) == 2 * n * 4 + 4 * len(params)  # + a float32 step counter each


def test_fira_state_is_smaller_than_adamw() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    opt = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=8, update_proj_gap=10), lr=1e-3)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    assert 0 < optimizer_state_numel(opt) < 2 * 2 * 64 * 64 / 2


def test_peak_memory_grows_with_an_allocation_and_resets() -> None:
    import mmap

    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    base = memory.peak_bytes()
    # 64 MiB of fresh anonymous pages, touched: resident whatever state malloc's heap is in (a
    # tensor could reuse freed heap that is still resident, depending on the tests run before).
    big = mmap.mmap(-1, 64 * 1024 * 1024)
    big.write(b"\1" * len(big))
    with_big = memory.peak_bytes()
    assert with_big >= base + 48 * 1024 * 1024
    big.close()  # unmapped: returned to the system
    memory.reset()
    assert 1024 * 1024 <= memory.peak_bytes() < with_big - 32 * 1024 * 1024


def test_perplexity() -> None:
    assert perplexity(0.0) == 1.0
    assert abs(perplexity(math.log(20.0)) - 20.0) < 1e-9
    assert perplexity(1e6) == float("inf")
