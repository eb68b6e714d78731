"""Config dataclasses: validation naming field and value."""

from __future__ import annotations

import pytest

from fira_train.config.run_config import ModelConfig, OptimConfig, RunConfig, TrainConfig


def test_defaults_are_valid() -> None:
    config = RunConfig()
    assert config.optim.method == "fira"
    assert config.train.grad_accum == 1


@pytest.mark.parametrize(
    ("kind", "kwargs", "name"),
    [
        (ModelConfig, {"hidden_size": 0}, "model.hidden_size"),
        (ModelConfig, {"hidden_size": 100, "num_attention_heads": 3}, "model.num_attention_heads"),
        (ModelConfig, {"num_key_value_heads": 3}, "model.num_key_value_heads"),
        (ModelConfig, {"initializer_range": -1.0}, "model.initializer_range"),
        (ModelConfig, {"initializer_range": 1.5}, "model.initializer_range"),
        (ModelConfig, {"num_hidden_layers": 2.5}, "model.num_hidden_layers"),
        (OptimConfig, {"lr": -0.1}, "optim.lr"),
        (OptimConfig, {"lr": float("nan")}, "optim.lr"),
        (OptimConfig, {"lr": 1e308}, "optim.lr"),  # finite, but no fp32 step can be taken with it
        (OptimConfig, {"alpha": 1e308}, "optim.alpha"),
        (OptimConfig, {"rank": 0}, "optim.rank"),
        (OptimConfig, {"update_proj_gap": 0}, "optim.update_proj_gap"),
        (OptimConfig, {"alpha": 0.0}, "optim.alpha"),
        (OptimConfig, {"alpha": float("inf")}, "optim.alpha"),
        (OptimConfig, {"gamma": float("inf")}, "optim.gamma"),
        (OptimConfig, {"eps": float("inf")}, "optim.eps"),
        (OptimConfig, {"weight_decay": float("inf")}, "optim.weight_decay"),
        (OptimConfig, {"betas": (0.9, 1.0)}, "optim.betas"),
        (OptimConfig, {"betas": (0.9,)}, "optim.betas"),
        (OptimConfig, {"weight_decay": -1e-3}, "optim.weight_decay"),
        (OptimConfig, {"relora_prune": 1.5}, "optim.relora_prune"),
        (OptimConfig, {"relora_every": 0}, "optim.relora_every"),
        (TrainConfig, {"steps": 0}, "train.steps"),
        (TrainConfig, {"steps": True}, "train.steps"),
        (TrainConfig, {"batch_size": 8, "micro_batch_size": 3}, "train.micro_batch_size"),
        (TrainConfig, {"warmup_fraction": 1.0}, "train.warmup_fraction"),
        (TrainConfig, {"min_lr_ratio": 2.0}, "train.min_lr_ratio"),
        (TrainConfig, {"grad_clip": -1.0}, "train.grad_clip"),
        (TrainConfig, {"eval_every": -1}, "train.eval_every"),
        (TrainConfig, {"keep_last": 0}, "train.keep_last"),
        (TrainConfig, {"precision": "fp8"}, "train.precision"),
        (TrainConfig, {"device": "tpu"}, "train.device"),
    ],
)
def test_invalid_values_name_field_and_value(kind, kwargs, name) -> None:
    with pytest.raises(ValueError) as err:
        kind(**kwargs)
    message = str(err.value)
    assert name in message
    assert repr(list(kwargs.values())[-1]) in message


def test_unknown_method_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="optim.method") as err:
        RunConfig(optim=OptimConfig(method="adamw2"))
    for name in ("adamw", "fira", "galore", "lora", "relora", "adam-mini"):
        assert name in str(err.value)


def test_grad_accum_is_batch_over_micro_batch() -> None:
    assert TrainConfig(batch_size=512, micro_batch_size=128).grad_accum == 4
    assert TrainConfig(batch_size=16).grad_accum == 1


@pytest.mark.parametrize("key,value", [("gamma", 0.5), ("projector", "qr"), ("implementation", "cuda"),
                                       ("host_refresh", "yes")])
def test_optim_fira_options_are_validated(key, value):
    with pytest.raises(ValueError, match=f"optim.{key}"):
        OptimConfig(**{key: value})


def test_optim_fira_options_reach_the_optimizer():
    from fira_train.methods.registry import build_method
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import get_recipe

    import torch

    config = apply_overrides(get_recipe("micro"), ["optim.gamma=1.1", "optim.projector=randomized",
                                                   "optim.implementation=reference", "optim.host_refresh=true"])
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = build_method(model, config).optimizer
    projected = [g for g in opt.param_groups if g["rank"] is not None]
    assert projected and all(g["gamma"] == 1.1 and g["projector"] == "randomized" for g in projected)
    assert opt.implementation == "reference" and opt.host_refresh is True
    assert all(g["state_rounding"] == "nearest" for g in opt.param_groups)
    states = apply_overrides(config, ["optim.state_dtype=bfloat16", "optim.state_rounding=stochastic"])
    assert all(g["state_dtype"] == "bfloat16" and g["state_rounding"] == "stochastic"
               for g in build_method(model, states).optimizer.param_groups)
    # A variant's own projector wins over optim.projector.
    only = apply_overrides(config, ["optim.method=fira-only-scaling-random"])
    assert all(g["projector"] == "random" for g in build_method(model, only).optimizer.param_groups
               if g["rank"] is not None)


def test_a_seed_numpy_cannot_take_is_refused_with_the_key() -> None:
    """numpy's own error ("Seed must be between 0 and 2**32 - 1") named no argument, and came once
    the run folder was made."""
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import micro

    assert apply_overrides(micro(), [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1
    for value in (2**32, -1):
        with pytest.raises(ValueError, match=rf"train.seed must be an integer in \[0, 4294967295\], got {value}"):
            apply_overrides(micro(), [f"train.seed={value}"])


def test_a_thread_count_the_process_cannot_start_is_refused_with_the_key() -> None:
    """train.num_threads=100000 crashed the interpreter in the first parallel kernel (a segmentation
    fault, no message)."""
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import micro
    from fira_train.config.run_config import MAX_THREADS

    assert apply_overrides(micro(), [f"train.num_threads={MAX_THREADS}"]).train.num_threads == MAX_THREADS
    assert apply_overrides(micro(), ["train.num_threads=0"]).train.num_threads == 0  # torch's default
    for value in (100000, MAX_THREADS + 1, -1):
        with pytest.raises(ValueError, match=rf"^train.num_threads must be an integer in \[0, 1024\] \(0: torch's "
                                             rf"default count\), got {value}$"):
            apply_overrides(micro(), [f"train.num_threads={value}"])
