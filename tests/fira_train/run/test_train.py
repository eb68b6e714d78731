"""The training loop: logs, token-averaged validation, accumulation, faults and exact resume."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fira_optim
import fira_train.run.training as training_module
from fira_train.config.overrides import apply_overrides, config_from_dict
from fira_train.config.run_config import ModelConfig
from fira_train.methods.model import build_model
from fira_train.run import checkpoint as ckpt
from fira_train.run.callbacks import TrainCallback
from fira_train.run.metrics import read_metrics
from fira_train.run.train import NonFiniteLossError, evaluate, train
from tests.fira_train.harness_fixtures import StopBefore, StopRun, micro_config, stop_at_checkpoint  # noqa: F401

REPO = Path(__file__).resolve().parents[3]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def test_run_writes_config_metrics_summary_and_checkpoints(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=fira", "train.tensorboard=true")
    summary = train(config)
    out = tmp_path / "run"
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 21))
    for record in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(record)
        assert math.isfinite(record["loss"]) and record["tokens_per_s"] > 0
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    for record in evals:
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
    assert records[0]["lr"] == pytest.approx(0.01 / 2)  # warm-up: 10% of 20 steps = 2 steps
    assert records[-1]["lr"] < 0.011 * 0.2  # cosine decay towards 10%
    saved = config_from_dict(json.loads((out / "config.json").read_text()))
    assert saved.optim.lr == 0.01 and saved.optim.method == "fira" and saved.train.steps == 20
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [10, 20]
    assert any((out / "tb").iterdir())
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert summary["val_loss"] == evals[-1]["val_loss"]
    assert summary["tokens"] == 20 * 8 * 32
    assert summary["optimizer_state_numel"] > 0 and summary["peak_memory_bytes"] > 0
    assert summary["rank"] == 16 and summary["method"] == "fira"
    # The held-out test set: evaluated once, at the end, on its own tokens.
    assert summary["test_tokens"] > 0 and summary["test_ppl"] == pytest.approx(math.exp(summary["test_loss"]))
    assert summary["test_loss"] != summary["val_loss"] and all("test_loss" not in r for r in records)


def test_validation_loss_is_averaged_over_tokens_not_batches() -> None:
    model = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_hidden_layers=1), vocab_size=50, max_seq_len=8, seed=0)
    data = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    batches = [data[:3], data[3:]]  # unequal batches: a mean of batch means would be wrong
    mean, tokens = evaluate(model, batches, torch.device("cpu"), nullcontext())
    with torch.no_grad():
        logits = model(input_ids=data).logits
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:, 1:].flatten(), reduction="none")
    assert tokens == 4 * 7
    assert mean == pytest.approx(per_token.mean().item(), rel=1e-6)
    batch_means = [per_token.view(4, 7)[:3].mean().item(), per_token.view(4, 7)[3:].mean().item()]
    assert abs(mean - sum(batch_means) / 2) > 1e-4  # the two averages differ on this data
    released = sum(batch_means) / (len(batches) + 1)  # the released harness's n + 1 division
    assert math.exp(released) < math.exp(mean)


def test_gradient_accumulation_matches_one_large_batch(tmp_path: Path) -> None:
    # fp32 on every device: under bf16 autocast (CUDA) the two batchings round differently.
    common = ("optim.method=adamw", "train.steps=3", "train.precision=fp32")
    a = train(micro_config(tmp_path, *common, "train.micro_batch_size=4", out="a"))
    b = train(micro_config(tmp_path, *common, "train.micro_batch_size=8", out="b"))
    assert _losses(tmp_path / "a") == pytest.approx(_losses(tmp_path / "b"), rel=1e-5)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path: Path, monkeypatch) -> None:
    calls = {"forward": 0}

    def poisoned(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def hook(module, inputs, output):
            calls["forward"] += 1
            if calls["forward"] == 5:  # 2 micro-batches per step: the first forward of step 3
                return output * float("nan")
            return output

        model.lm_head.register_forward_hook(hook)
        return model

    monkeypatch.setattr(training_module, "build_model", poisoned)
    config = micro_config(tmp_path, "optim.method=adamw", "train.save_every=2", "train.eval_every=0")
    with pytest.raises(NonFiniteLossError, match="at step 3") as err:
        train(config)
    assert err.value.step == 3
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path / "run")] == [2]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_an_existing_run_needs_resume_or_overwrite(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=2")
    train(config)
    with pytest.raises(FileExistsError, match="--resume"):
        train(config)
    train(config, overwrite=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_runs_whose_out_and_cache_lie_inside_the_corpus_folder_do_not_read_them(tmp_path: Path) -> None:
    """--out and data.cache_dir inside the folder of corpus files: the second run read the first's
    config.json and the cache's JSON files as documents, and failed on them."""
    common = ("optim.method=adamw", "train.steps=1", f"data.cache_dir={tmp_path / 'corpus' / 'cache'}")
    first = train(micro_config(tmp_path, *common, out="corpus/runs/a"))
    again = train(micro_config(tmp_path, *common, out="corpus/runs/a"), overwrite=True)
    other = train(micro_config(tmp_path, *common, out="corpus/runs/b"))
    assert first["data"]["token_digest"] == again["data"]["token_digest"] == other["data"]["token_digest"]


def test_an_out_that_is_the_corpus_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Refused for its files without --overwrite, the first run trained with it, and every later
    start (a --resume, an --overwrite) read its config.json and metrics.jsonl as documents."""
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", out="corpus")
    before = sorted(p.name for p in (tmp_path / "corpus").iterdir())
    with pytest.raises(ValueError, match=r"output folder .*corpus' \(--out\) is the corpus folder"):
        train(config, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == before


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    train(micro_config(tmp_path, "optim.method=adamw", "train.steps=4"))
    lr = json.loads((tmp_path / "run" / "config.json").read_text())["optim"]["lr"]
    with pytest.raises(ValueError, match=re.escape(f"its config.json has optim.lr={lr!r} (now 0.5)")):
        train(micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "optim.lr=0.5"), resume="latest")
    # fields that do not change the trajectory may differ
    train(micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.keep_last=5"), resume="latest")



def test_a_start_refused_for_its_data_or_settings_writes_nothing_and_deletes_nothing(tmp_path: Path) -> None:
    """config.json was written before the data was read: a start refused for a missing or too
    small corpus (or a batch larger than it) left the refused config, which a --resume with the
    corrected command then refused to differ from; and --overwrite deleted the run there first."""
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=2")
    missing = apply_overrides(config, [f"data.source={tmp_path / 'missing.txt'}"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train(missing)
    assert not (tmp_path / "run" / "config.json").exists()
    with pytest.raises(ValueError, match="train.batch_size=100000"):
        train(apply_overrides(config, ["train.batch_size=100000"]))
    assert not (tmp_path / "run" / "config.json").exists()
    train(config, resume="latest")  # the corrected command: no refused config stands in its way
    kept = (tmp_path / "run" / "summary.json").read_text()
    with pytest.raises(FileExistsError, match="already holds a run"):  # said before the data is read
        train(missing)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train(missing, overwrite=True)
    assert (tmp_path / "run" / "summary.json").read_text() == kept
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path / "run")] == [2]


def test_a_start_that_writes_nothing_removes_the_folders_its_lock_made(tmp_path: Path) -> None:
    """The lock made --out (and its missing parents) before the data was read: a refused start
    left a folder holding only the lock file. One that was there before stays."""
    runs = tmp_path / "runs"
    runs.mkdir()
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train(micro_config(tmp_path, f"data.source={tmp_path / 'missing.txt'}", out="runs/new/run"))
    assert list(runs.iterdir()) == []  # neither run nor the parent made for it
    (runs / "mine").mkdir()
    with pytest.raises(ValueError, match="train.batch_size=100000"):
        train(micro_config(tmp_path, "train.batch_size=100000", out="runs/mine"))
    assert (runs / "mine").is_dir()  # the user's folder: never removed

def _straight_and_resumed(tmp_path: Path, monkeypatch, common: list[str]) -> tuple[dict, dict]:
    """The summaries of the run of ``common`` trained straight (in ``straight``) and stopped right
    after saving step 6, then resumed (in ``resumed``)."""
    straight = train(micro_config(tmp_path, *common, out="straight"))
    go_on = stop_at_checkpoint(monkeypatch, 6, saved=True)
    with pytest.raises(StopRun):
        train(micro_config(tmp_path, *common, out="resumed"))
    go_on()
    return straight, train(micro_config(tmp_path, *common, out="resumed"), resume="latest")


@pytest.mark.parametrize("method", ["fira", "relora"])
def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path: Path, monkeypatch, method: str) -> None:
    # save every 3 steps: step 6 is not a multiple of T=5, and the resumed part crosses the
    # refresh at step 10 (fira) and the restart at step 8 (relora, every 4 steps)
    common = [f"optim.method={method}", "train.steps=12", "train.save_every=3", "train.eval_every=4",
              "optim.relora_every=4", "train.keep_last=5"]
    straight, resumed = _straight_and_resumed(tmp_path, monkeypatch, common)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # exact, every step
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == list(range(1, 13))
    assert resumed["val_loss"] == straight["val_loss"]


@pytest.mark.parametrize("method", [("optim.method=adamw",),
                                    ("optim.method=fira", "optim.step_in_backward=true", "train.grad_clip=0")])
def test_fp16_with_loss_scaling_trains_and_resumes_exactly(tmp_path: Path, monkeypatch, method) -> None:
    # GradScaler with a plain step, the handle's own scale with step-in-backward: both in
    # checkpoints. Growing every 2 steps, the scale differs at each checkpoint.
    import fira_optim.backward

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "growth_interval": 2})

    class LossScale(fira_optim.LossScale):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "growth_interval": 2})

    monkeypatch.setattr(torch.amp, "GradScaler", GradScaler)
    monkeypatch.setattr(fira_optim.backward, "LossScale", LossScale)
    common = [*method, "train.precision=fp16", "train.steps=8", "train.save_every=3", "train.eval_every=0",
              "train.keep_last=5"]
    straight, resumed = _straight_and_resumed(tmp_path, monkeypatch, common)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    assert resumed["val_loss"] == straight["val_loss"] and math.isfinite(straight["val_loss"])
    def scales(run: str) -> list[float]:
        return [torch.load(path / ckpt.STATE_FILE, weights_only=True)["loss_scale"]["scale"]
                for _, path in ckpt.complete_checkpoints(tmp_path / run)]

    assert len(set(scales("straight"))) == 3  # the scale moved between checkpoints 3, 6 and 8
    assert scales("resumed") == scales("straight")  # continued from the checkpoint's, not 2**16


def _overflow_lm_head_at(monkeypatch, backward: int) -> None:
    """The runs' models get an Inf gradient of lm_head.weight in their ``backward``-th backward
    pass (2 micro-batches per step: 5 is the first of step 3, 6 its last)."""
    calls = {"backward": 0}

    def poisoned(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def hook(grad):
            calls["backward"] += 1
            return torch.full_like(grad, float("inf")) if calls["backward"] == backward else grad

        model.lm_head.weight.register_hook(hook)
        return model

    monkeypatch.setattr(training_module, "build_model", poisoned)


def test_an_fp16_overflow_skips_the_step_and_the_schedule(tmp_path: Path, monkeypatch) -> None:
    _overflow_lm_head_at(monkeypatch, 5)
    config = micro_config(tmp_path, "optim.method=fira", "train.precision=fp16", "train.steps=4",
                          "train.save_every=1", "train.keep_last=4", "train.eval_every=0")
    seen = _AfterSteps()
    summary = train(config, callbacks=[seen])
    assert seen.steps == [1, 2, 4] and summary["skipped_steps"] == 1  # no update to see at step 3
    records = read_metrics(tmp_path / "run")
    assert [r.get("skipped", False) for r in records] == [False, False, True, False]
    assert [r["loss_scale"] for r in records] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    states = {step: torch.load(path / ckpt.STATE_FILE, weights_only=True)
              for step, path in ckpt.complete_checkpoints(tmp_path / "run")}
    for name, value in states[3]["model"].items():  # step 3 changed no weight
        assert torch.equal(value, states[2]["model"][name]), name
    assert not torch.equal(states[4]["model"]["lm_head.weight"], states[3]["model"]["lm_head.weight"])
    assert [states[s]["loss_scale"]["scale"] for s in (2, 3)] == [2.0 ** 16, 2.0 ** 15]
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert lrs[3] == lrs[2] != lrs[1]  # the schedule did not move for the skipped step


def test_an_fp16_overflow_in_backward_skips_its_matrices_and_the_step_goes_on(tmp_path: Path, monkeypatch) -> None:
    _overflow_lm_head_at(monkeypatch, 6)  # the last backward of step 3, where the updates run
    config = micro_config(tmp_path, "optim.method=fira", "optim.step_in_backward=true", "train.grad_clip=0",
                          "train.precision=fp16", "train.steps=4", "train.eval_every=0", "train.save_every=0")
    seen = _AfterSteps()
    summary = train(config, callbacks=[seen])
    records = read_metrics(tmp_path / "run")
    assert seen.steps == [1, 2, 3, 4] and summary["skipped_steps"] == 0 and summary["skipped_updates"] == 1
    assert [r.get("skipped_updates", 0) for r in records] == [0, 0, 1, 0]
    assert [r["loss_scale"] for r in records] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    # stopped after the checkpoint of step 3 and resumed: the count comes back with the scale
    _overflow_lm_head_at(monkeypatch, 6)
    go_on = stop_at_checkpoint(monkeypatch, 3, saved=True)
    stopped = apply_overrides(config, ["train.save_every=1", f"train.out_dir={tmp_path / 'stopped'}"])
    with pytest.raises(StopRun):
        train(stopped)
    go_on()
    _overflow_lm_head_at(monkeypatch, 0)  # no overflow in the second sitting
    assert train(stopped, resume="latest")["skipped_updates"] == 1


class _AfterSteps(TrainCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def after_step(self, step, model, optimizer, loss) -> None:
        self.steps.append(step)


def test_a_skipped_fp16_step_moves_relora_s_merges_with_its_schedule(tmp_path: Path, monkeypatch) -> None:
    # merges every 2 applied updates, where the schedule re-warms: step 2 skipped, so after the
    # updates of steps 3 and 5 (the loop's count merged after steps 2 and 4, out of step with it)
    import fira_train.methods.lora as lora

    seen, merged = _AfterSteps(), []
    _overflow_lm_head_at(monkeypatch, 3)  # the first backward of step 2
    real_merge = lora.merge_and_reinit_lora
    monkeypatch.setattr(lora, "merge_and_reinit_lora", lambda model: merged.append(seen.steps[-1]) or real_merge(model))
    train(micro_config(tmp_path, "optim.method=relora", "optim.relora_every=2", "train.precision=fp16",
                       "train.steps=6", "train.eval_every=0", "train.save_every=0"), callbacks=[seen])
    assert seen.steps == [1, 3, 4, 5, 6] and merged == [3, 5]


def test_fp16_refuses_bf16_weights_and_fsdp2(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.param_dtype.*float32 with train.precision='fp16'"):
        micro_config(tmp_path, "train.precision=fp16", "train.param_dtype=bfloat16")
    with pytest.raises(ValueError, match="train.precision.*with train.parallel='fsdp2'"):
        micro_config(tmp_path, "train.precision=fp16", "train.parallel=fsdp2")


def test_kill_9_while_writing_a_checkpoint_then_resume_exactly(tmp_path: Path) -> None:
    common = ["optim.method=fira", "train.steps=9", "train.save_every=3", "train.eval_every=0"]
    straight_config = micro_config(tmp_path, *common, out="straight")
    train(straight_config)
    killed_config = micro_config(tmp_path, *common, out="killed")
    flags = [f"{k}={v}" for k, v in [
        ("data.source", killed_config.data.source), ("data.cache_dir", killed_config.data.cache_dir),
        ("data.vocab_size", 300), ("data.val_fraction", 0.1), ("train.out_dir", killed_config.train.out_dir),
        ("train.progress", "false"), ("train.tensorboard", "false"), ("train.num_threads", 1)]]
    # In a separate process, SIGKILL ourselves in the middle of writing the step-6 checkpoint:
    # state.pt and the marker are in the temporary directory, the rename has not happened.
    driver = textwrap.dedent(f"""
        import os, signal, sys
        import fira_train.run.checkpoint as ckpt
        real_rename = os.rename
        def rename(src, dst):
            if str(dst).endswith("step_00000006"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
        ckpt.os.rename = rename
        from fira_train.cli import main
        sys.exit(main(["pretrain", "--recipe", "micro", "--method", "fira", "--steps", "9",
                       "--save-every", "3", "--eval-every", "0", *{flags!r}]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    out = tmp_path / "killed"
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [3]
    assert any(p.name.startswith(".tmp-step_00000006") for p in (out / "checkpoints").iterdir())
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))

    train(killed_config, resume="latest")
    assert _losses(out) == _losses(tmp_path / "straight")
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


def test_a_full_disk_while_writing_a_checkpoint_leaves_no_partial_folder_and_the_run_resumes(
        tmp_path: Path, monkeypatch) -> None:
    """The error goes on, with its message; the partial checkpoint's folder is removed at once
    (it held disk space until a resume); the previous checkpoint resumes the run exactly."""
    from tests.fira_train.harness_fixtures import full_disk_at

    common = ["optim.method=fira", "train.steps=9", "train.save_every=3", "train.eval_every=0"]
    train(micro_config(tmp_path, *common, out="straight"))
    config = micro_config(tmp_path, *common, out="full")
    monkeypatch.setattr(torch, "save", full_disk_at(".tmp-step_00000006", torch.save))
    with pytest.raises(OSError, match="No space left on device"):
        train(config)
    monkeypatch.undo()
    out = tmp_path / "full"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000003"]
    train(config, resume="latest")
    assert _losses(out) == _losses(tmp_path / "straight")


def test_resume_requests_and_failures(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=2")
    train(config, resume="latest")  # nothing to resume: starts from step 0
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path / "run")] == [2, 4]
    with pytest.raises(FileNotFoundError, match="step 3"):
        train(config, resume=3)
    first = json.loads((tmp_path / "run" / "summary.json").read_text())
    again = train(config, resume=4)  # a finished run: nothing to train, same result
    assert again["val_loss"] == first["val_loss"] and again["steps"] == 4
    state = tmp_path / "run" / "checkpoints" / "step_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        train(config, resume=4)  # asked for by step: an error naming it ("latest" falls back)


def test_bf16_autocast_only_where_asked_on_cpu(tmp_path: Path) -> None:
    config = micro_config(tmp_path)
    cpu = torch.device("cpu")
    assert isinstance(training_module.autocast_for(config, cpu), nullcontext)
    bf16 = apply_overrides(config, ["train.precision=bf16"])
    assert isinstance(training_module.autocast_for(bf16, cpu), torch.autocast)


def test_a_finished_run_trained_again_from_an_earlier_step_is_not_finished_until_it_ends(tmp_path: Path) -> None:
    """A finished run resumed from an earlier step with a memory lever, and stopped before its
    next save, kept its summary.json beside the new config.json: a later --resume with the lever
    returned that summary (trained and measured without it) as the finished run, and compare
    --resume reused it in its report. The sitting now removes the summary it will replace."""
    from fira_train.run.run_dir import finished_with

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=2",
                          "train.keep_last=5", "train.eval_every=0")
    lever = apply_overrides(config, ["train.activation_checkpointing=true"])
    out = tmp_path / "run"
    train(config)
    with pytest.raises(StopRun):
        train(lever, resume=2, callbacks=[StopBefore(3)])
    assert not finished_with(lever, out)
    with pytest.raises(ValueError, match=r"activation_checkpointing=False \(now True\): it is the run's last step"):
        train(lever, resume="latest")  # the final checkpoint, kept, was trained without it
    summary = train(config, resume="latest")  # evaluated again, nothing trained
    assert summary["steps"] == 4 and json.loads((out / "summary.json").read_text())["steps"] == 4


def test_a_resume_refused_when_its_checkpoint_is_restored_leaves_a_finished_run_as_it_was(tmp_path: Path) -> None:
    """A finished run resumed from an earlier step on data changed since is refused as the
    checkpoint is restored: its summary.json and config.json are as before (the summary was
    deleted before the refusal, and only the data it was trained on gave it back)."""
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=2",
                          "train.keep_last=5", "train.eval_every=0")
    out = tmp_path / "run"
    train(config)
    kept = {name: (out / name).read_bytes() for name in ("summary.json", "config.json")}
    with open(next((tmp_path / "corpus").iterdir()), "a", encoding="utf-8") as handle:
        handle.write("\nAn extra document, written after the run finished, about a river and a mountain.\n")
    with pytest.raises(ValueError, match="trained on other data"):
        train(config, resume=2)
    assert {name: (out / name).read_bytes() for name in kept} == kept
