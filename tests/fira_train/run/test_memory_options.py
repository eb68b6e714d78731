"""The memory options of a run: updates in the backward pass, low-precision optimizer states,
bf16 weights and activation checkpointing (config, training loop, refusals)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from fira_train.run.metrics import read_metrics
from fira_train.run.train import train
from fira_train.run.training import build_training, resolve_device
from tests.fira_train.harness_fixtures import micro_config


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(sorted((run_dir / "checkpoints").iterdir())[-1] / "state.pt", weights_only=True)
    return state["model"]


@pytest.mark.parametrize("accumulation", [False, True], ids=["one-micro-batch", "accumulated"])
def test_step_in_backward_trains_as_the_normal_step(tmp_path: Path, accumulation: bool) -> None:
    common = ["optim.method=fira", "train.steps=4", "train.precision=fp32", "train.save_every=4",
              "train.eval_every=4"]
    if accumulation:
        common.append("train.micro_batch_size=4")
    train(micro_config(tmp_path, *common, out="plain"))
    train(micro_config(tmp_path, *common, "optim.step_in_backward=true", out="hooks"))
    plain, hooks = _losses(tmp_path / "plain"), _losses(tmp_path / "hooks")
    if accumulation:  # the same sums of gradients, updated in another order of operations
        assert hooks == pytest.approx(plain, rel=1e-5)
    else:  # bit for bit
        assert hooks == plain
        for key, value in _weights(tmp_path / "plain").items():
            assert torch.equal(value, _weights(tmp_path / "hooks")[key]), key


def test_step_in_backward_refuses_global_clipping_and_other_methods(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.grad_clip.*optim.step_in_backward"):
        micro_config(tmp_path, "optim.step_in_backward=true", "train.grad_clip=1.0")
    with pytest.raises(ValueError, match="optim.step_in_backward=True needs a Fira-family method"):
        micro_config(tmp_path, "optim.method=adamw", "optim.step_in_backward=true")
    with pytest.raises(ValueError, match="optim.state_dtype.*one of"):
        micro_config(tmp_path, "optim.state_dtype=int4")


@pytest.mark.parametrize("options", [
    ("optim.state_dtype=bfloat16",),
    ("optim.state_dtype=bfloat16", "optim.state_rounding=stochastic"),
    ("optim.state_dtype=int8", "model.hidden_size=64", "model.intermediate_size=256"),
    ("train.param_dtype=bfloat16", "optim.stochastic_rounding=true"),
    ("train.activation_checkpointing=true",),
], ids=["bf16-states", "bf16-states-stochastic", "int8-states", "bf16-weights", "checkpointing"])
def test_memory_options_train_close_to_the_plain_run(tmp_path: Path, options) -> None:
    common = ["optim.method=fira", "train.steps=6", "train.precision=fp32", "train.eval_every=6",
              "train.save_every=3", *(o for o in options if o.startswith("model."))]
    base = train(micro_config(tmp_path, *common, out="plain"))
    other = train(micro_config(tmp_path, *common, *options, out="other"))
    assert other["val_loss"] == pytest.approx(base["val_loss"], rel=0.03)
    if "train.activation_checkpointing=true" in options:  # recomputation is exact
        assert _losses(tmp_path / "other") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-6)
    # and resumes exactly: steps 4-6 again from the step-3 checkpoint
    uninterrupted = _losses(tmp_path / "other")
    train(micro_config(tmp_path, *common, *options, out="other"), resume=3)
    assert _losses(tmp_path / "other") == uninterrupted


def test_activation_checkpointing_recomputes_exactly_under_step_in_backward(tmp_path: Path) -> None:
    """The hooks update a layer's weights after its backward; the recomputation of an earlier
    layer reads that layer's own weights, not yet updated: the same losses as without it."""
    common = ["optim.method=fira", "train.steps=4", "train.precision=fp32", "train.eval_every=4",
              "train.save_every=0", "optim.step_in_backward=true", "optim.state_dtype=int8",
              "model.hidden_size=64", "model.intermediate_size=256"]
    train(micro_config(tmp_path, *common, out="plain"))
    train(micro_config(tmp_path, *common, "train.activation_checkpointing=true", out="ckpt"))
    assert _losses(tmp_path / "ckpt") == _losses(tmp_path / "plain")


def test_bf16_weights_are_bf16(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=fira", "train.param_dtype=bfloat16")
    training = build_training(config, 300, resolve_device(config))
    assert {p.dtype for p in training.model.parameters()} == {torch.bfloat16}


def test_activation_checkpointing_is_switched_on_without_a_deprecation_warning(tmp_path: Path) -> None:
    import warnings

    config = micro_config(tmp_path, "optim.method=fira", "train.activation_checkpointing=true")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        training = build_training(config, 300, resolve_device(config))
    assert training.model.is_gradient_checkpointing


def test_with_step_in_backward_the_updates_happen_in_backward(tmp_path: Path) -> None:
    from fira_train.data.build import build_corpus
    from fira_train.run.train import train_step

    config = micro_config(tmp_path, "optim.method=fira", "optim.step_in_backward=true")
    corpus = build_corpus(config.data)
    training = build_training(config, corpus.vocab_size, torch.device("cpu"))
    assert training.in_backward is not None
    before = {n: p.detach().clone() for n, p in training.model.named_parameters()}
    calls = []
    training.optimizer.step = lambda *a, **k: calls.append(1)  # the loop's step() changes nothing
    train_step(training, config, corpus.train_batches(8, 0), torch.autocast("cpu", enabled=False), 1)
    assert calls == [1]
    assert all(p.grad is None for p in training.model.parameters())
    changed = [n for n, p in training.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # every parameter was updated during backward


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.host_refresh=true"], "optim.host_refresh=true changes nothing on the CPU"),
    (["optim.stochastic_rounding=true"], r"optim.stochastic_rounding=true changes nothing with "
                                         r"train.param_dtype='float32'"),
])
def test_a_setting_that_changes_nothing_here_is_warned_of(tmp_path: Path, overrides: list[str], message: str) -> None:
    """Each was taken without a word: host_refresh on the CPU, stochastic rounding of fp32 weights."""
    config = micro_config(tmp_path, "optim.method=fira", "train.device=cpu", *overrides)
    with pytest.warns(UserWarning, match=message):
        build_training(config, 300, resolve_device(config))
    if overrides == ["optim.host_refresh=true"]:  # AdamW does not read it: the command line says so, not this
        adamw = micro_config(tmp_path, "optim.method=adamw", "train.device=cpu", *overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_training(adamw, 300, resolve_device(adamw))
