"""The method registry: every name builds, steps and checkpoints; LoRA / ReLoRA mechanics."""

from __future__ import annotations

import io

import pytest
import torch

import fira_optim
from fira_train.config.resolve import resolved_lr
from fira_train.methods.lora import LORA_TARGETS, lora_layers, merge_and_reinit_lora, prune_moments
from fira_train.methods.registry import METHODS, build_method, get_method
from tests.fira_train.methods.method_fixtures import (
    learnable_batch,
    method_config,
    method_model,
    train_step,
)


def test_registry_holds_every_method_of_the_issue() -> None:
    expected = {"adamw", "lora", "relora", "sgd", "adagrad", "adam-mini", "fira", "fira-matrix",
                "fira-no-scaling", "fira-no-limiter", "fira-clip", "fira-shrink", "fira-tensorwise",
                "fira-only-scaling", "fira-only-scaling-random", "fira-released", "galore", "galore-add",
                "fira-adagrad", "galore-adagrad", "frugal"}
    assert expected <= set(METHODS)
    assert set(fira_optim.VARIANTS) <= set(METHODS)


def test_unknown_method_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown method 'adam'") as err:
        get_method("adam")
    for name in METHODS:
        assert name in str(err.value)


def test_default_learning_rates() -> None:
    assert get_method("fira").default_lr == 0.01
    assert get_method("galore").default_lr == 0.01
    assert get_method("adamw").default_lr == 1e-3
    assert resolved_lr(method_config("fira")) == 0.01
    assert resolved_lr(method_config("fira", "optim.lr=0.002")) == 0.002


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_and_its_state_loads_weights_only(method: str) -> None:
    config = method_config(method)
    setup = build_method(method_model(config), config)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters() if p.requires_grad}
    losses = [train_step(setup, learnable_batch()) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    changed = [n for n, p in setup.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, f"{method} changed no parameter"
    assert setup.optimizer.param_groups[0]["lr"] == pytest.approx(resolved_lr(config))
    buffer = io.BytesIO()
    torch.save(setup.optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = build_method(method_model(config), config)
    fresh.optimizer.load_state_dict(state)


#: A valid value other than :func:`method_config`'s for every ``optim`` setting a method may
#: ignore (the Fira-only memory options are refused, not ignored: tested with the config).
OTHER_VALUES = {"rank": "4", "update_proj_gap": "1", "alpha": "0.5", "betas": "0.8,0.95", "eps": "0.001",
                "weight_decay": "0.1", "gamma": "1.001", "projector": "randomized",
                "implementation": "reference", "host_refresh": "true", "align_signs": "true",
                "lora_alpha": "8", "lora_dropout": "0.1", "relora_every": "1", "relora_prune": "0.5",
                "relora_rewarmup": "2"}


def _trained(config) -> tuple[dict[str, torch.Tensor], tuple]:
    """The weights after three steps on one batch, and the schedule the method asks for."""
    torch.manual_seed(0)  # LoRA's adapters, dropout
    setup = build_method(method_model(config), config)
    for step in range(1, 4):
        train_step(setup, learnable_batch())
        if setup.after_step is not None:
            setup.after_step(step)
    weights = {n: p.detach().clone() for n, p in setup.model.state_dict().items()}
    return weights, (setup.restart_every, setup.rewarmup)


@pytest.mark.parametrize("method", list(METHODS))
def test_the_settings_a_method_does_not_use_change_nothing(method: str) -> None:
    """What ``Method.uses`` leaves out has no effect, so fira-train's warning ("not used by") is
    true; weight decay, which every method uses, shows that a change is seen."""
    from fira_train.config.run_config import FIRA_ONLY, OptimConfig

    uses = get_method(method).uses
    unused = [k for k in OptimConfig.__dataclass_fields__ if k not in uses | {"method", "lr", *FIRA_ONLY}]
    assert set(unused) <= set(OTHER_VALUES), "give every setting another value here"
    base = method_config(method, "train.steps=6")
    weights, schedule = _trained(base)
    for key in unused:
        other, other_schedule = _trained(method_config(method, "train.steps=6", f"optim.{key}={OTHER_VALUES[key]}"))
        assert other_schedule == schedule, key
        for name, value in weights.items():
            assert torch.equal(other[name], value), (key, name)
    assert "weight_decay" in uses
    decayed, _ = _trained(method_config(method, "train.steps=6", "optim.weight_decay=0.1"))
    assert any(not torch.equal(decayed[n], v) for n, v in weights.items())


def test_the_fira_only_options_are_refused_for_other_methods() -> None:
    for key, value in (("step_in_backward", "true"), ("state_dtype", "bfloat16"), ("stochastic_rounding", "true"),
                       ("state_rounding", "stochastic")):
        assert key in get_method("fira").uses
        # stochastic state rounding needs bf16 states, which adamw refuses first
        stochastic_states = key == "state_rounding"
        given = [f"optim.{key}={value}", *(["optim.state_dtype=bfloat16"] if stochastic_states else [])]
        method_config("galore", *given)
        refused = "state_dtype" if stochastic_states else key
        with pytest.raises(ValueError, match=f"optim.{refused}=.* needs a Fira-family method.*'adamw'"):
            method_config("adamw", *given)
    # stochastic state rounding alone: refused for the method, not sent to set state_dtype=bfloat16,
    # which the method refuses next
    with pytest.raises(ValueError, match="optim.state_rounding='stochastic' needs a Fira-family method.*'adamw'"):
        method_config("adamw", "optim.state_rounding=stochastic")


@pytest.mark.parametrize("method", ["adamw", "fira"])
def test_loss_decreases_over_20_steps(method: str) -> None:
    config = method_config(method, "optim.rank=16", "optim.update_proj_gap=5")
    setup = build_method(method_model(config), config)
    batch = learnable_batch()
    losses = [train_step(setup, batch) for _ in range(20)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses


def test_fira_projects_the_linear_layers_only() -> None:
    config = method_config("fira")
    setup = build_method(method_model(config), config)
    projected = [g for g in setup.optimizer.param_groups if g.get("rank") is not None]
    assert projected and all(p.dim() == 2 for g in projected for p in g["params"])
    embedding = setup.model.get_input_embeddings().weight
    assert all(embedding is not p for g in projected for p in g["params"])
    assert projected[0]["rank"] == 8 and projected[0]["update_proj_gap"] == 2


def test_adamw_grouped_gives_fira_s_step_sizes_to_full_rank_adamw() -> None:
    config = method_config("adamw-grouped", "optim.alpha=0.5", "optim.lr=0.02")
    model = method_model(config)
    setup = build_method(model, config)
    fira_groups = build_method(method_model(method_config("fira")), method_config("fira")).optimizer.param_groups
    assert isinstance(setup.optimizer, torch.optim.AdamW) and get_method("adamw-grouped").default_lr == 0.01
    regular, matrices = setup.optimizer.param_groups
    assert (regular["lr"], matrices["lr"]) == (0.02, 0.01)  # lr, alpha * lr
    # weight decay per step lr * wd for every weight, as Fira's
    decayed = build_method(method_model(config), method_config("adamw-grouped", "optim.alpha=0.5", "optim.lr=0.02",
                                                   "optim.weight_decay=0.1")).optimizer.param_groups
    assert [g["lr"] * g["weight_decay"] for g in decayed] == [pytest.approx(0.002)] * 2
    # the same split as Fira's: the projected matrices at alpha * lr
    assert [p.shape for p in matrices["params"]] == [p.shape for p in fira_groups[1]["params"]]
    assert any(p is model.get_input_embeddings().weight for p in regular["params"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, lambda step: 0.5)
    scheduler.step()
    assert [g["lr"] for g in setup.optimizer.param_groups] == [0.01, 0.005]  # the ratio holds


def test_align_signs_is_the_variant_s_unless_set() -> None:
    def built(method: str, *overrides: str) -> bool:
        config = method_config(method, *overrides)
        return build_method(method_model(config), config).optimizer.defaults["align_signs"]

    assert built("fira") is False and built("fira-released") is False  # raw SVD signs, as Algorithm 1
    assert built("galore") is False
    assert built("fira", "optim.align_signs=true") is True
    assert built("fira-released", "optim.align_signs=false") is False
    with pytest.raises(ValueError, match="optim.align_signs=True contradicts method 'fira-released'"):
        built("fira-released", "optim.align_signs=true")
    with pytest.raises(ValueError, match="optim.align_signs"):
        method_config("fira", "optim.align_signs=3")


def test_lora_freezes_only_the_adapted_matrices() -> None:
    config = method_config("lora")
    setup = build_method(method_model(config), config)
    trainable = {n for n, p in setup.model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in setup.model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.endswith("base_layer.weight") for n in frozen)
    assert len(frozen) == len(LORA_TARGETS) * config.model.num_hidden_layers
    assert any("embed_tokens" in n for n in trainable) and any("lm_head" in n for n in trainable)
    assert any("norm" in n for n in trainable)
    assert all(p.shape[0] == 8 for n, p in setup.model.named_parameters() if "lora_A" in n)


@pytest.mark.parametrize("method", ["lora", "relora"])
def test_lora_does_not_pass_on_peft_reading_a_deprecated_transformers_attribute(method: str) -> None:
    """peft's get_peft_model reads is_gradient_checkpointing, which transformers deprecated: every
    pre-training run of lora and relora printed transformers' FutureWarning about it."""
    import warnings

    config = method_config(method)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = build_method(method_model(config), config)
        warnings.warn("`is_gradient_checkpointing` is deprecated, said after peft", FutureWarning)
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == [
        "`is_gradient_checkpointing` is deprecated, said after peft"]  # filtered around peft only
    assert lora_layers(setup.model)


def test_stochastic_rounding_of_float32_weights_is_one_warning_in_the_config_s_terms() -> None:
    """FiraAdamW warned once per parameter group that param_groups[i] held no bfloat16 parameter:
    two lines in the optimizer's terms for one setting, naming neither it nor train.param_dtype."""
    import warnings

    config = method_config("fira", "optim.stochastic_rounding=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_method(method_model(config), config)
    assert [str(w.message) for w in caught] == [
        "optim.stochastic_rounding=true changes nothing with train.param_dtype='float32': it rounds "
        "the updates of bfloat16 weights (train.param_dtype=bfloat16)"]
    config = method_config("fira", "optim.stochastic_rounding=true", "train.param_dtype=bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_method(method_model(config).to(torch.bfloat16), config)
    assert not caught


def test_adam_mini_is_told_the_architecture() -> None:
    config = method_config("adam-mini")
    setup = build_method(method_model(config), config)
    assert setup.optimizer.dim == config.model.hidden_size
    assert setup.optimizer.n_heads == config.model.num_attention_heads


def test_relora_merge_keeps_the_function_and_restarts_the_adapters() -> None:
    config = method_config("relora")
    setup = build_method(method_model(config), config)
    for _ in range(3):
        train_step(setup, learnable_batch())
    probe = learnable_batch(seed=1)
    with torch.no_grad():
        before = setup.model(input_ids=probe).logits
    layer = lora_layers(setup.model)[0]
    old_a = layer.lora_A["default"].weight.detach().clone()
    adapters = merge_and_reinit_lora(setup.model)
    with torch.no_grad():
        after = setup.model(input_ids=probe).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
    assert not torch.equal(layer.lora_A["default"].weight, old_a)
    assert len(adapters) == 2 * len(lora_layers(setup.model))


def test_relora_restarts_on_schedule() -> None:
    config = method_config("relora", "optim.relora_every=2", "optim.relora_prune=1.0", "train.steps=6")
    setup = build_method(method_model(config), config)
    assert setup.restart_every == 2
    layer = lora_layers(setup.model)[0]
    b = layer.lora_B["default"].weight
    train_step(setup, learnable_batch())
    setup.after_step(1)
    assert torch.count_nonzero(b) > 0  # no restart after step 1
    train_step(setup, learnable_batch())
    setup.after_step(2)
    assert torch.count_nonzero(b) == 0  # restarted after step 2
    assert torch.count_nonzero(setup.optimizer.state[b]["exp_avg"]) == 0  # relora_prune=1: reset


def test_relora_default_rewarmup_ramps_after_every_restart() -> None:
    """2% of a cycle (ReLoRA's 100 of 5000), but a ramp of at least 10 steps where a quarter of a
    cycle allows one: at tiny's 300 steps 2% of a 75-step cycle was one step, no ramp at all."""
    from fira_train.methods.lora import default_rewarmup
    from fira_train.run.schedule import WarmupCosine

    assert [default_rewarmup(e) for e in (5000, 1000, 75, 20, 5, 1)] == [100, 20, 10, 5, 1, 1]
    config = method_config("relora", "train.steps=300")
    setup = build_method(method_model(config), config)
    assert (setup.restart_every, setup.rewarmup) == (75, 10)
    jagged = WarmupCosine(300, config.train.warmup_fraction, config.train.min_lr_ratio, 75, setup.rewarmup)
    plain = WarmupCosine(300, config.train.warmup_fraction, config.train.min_lr_ratio)
    assert jagged(75) == pytest.approx(plain(75) / 10)  # the first step after the first restart
    assert jagged(85) == plain(85)  # ramped back


def test_prune_moments_zeroes_the_smallest_magnitudes() -> None:
    param = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.AdamW([param])
    opt.state[param] = {"step": torch.tensor(3.0), "exp_avg": torch.arange(1.0, 11.0),
                        "exp_avg_sq": -torch.arange(1.0, 11.0)}
    prune_moments(opt, [param], 0.7)
    assert opt.state[param]["exp_avg"].tolist() == [0.0] * 7 + [8.0, 9.0, 10.0]
    assert opt.state[param]["exp_avg_sq"].tolist() == [0.0] * 7 + [-8.0, -9.0, -10.0]
    assert opt.state[param]["step"].item() == 3.0
    prune_moments(opt, [param], 1.0)
    assert torch.count_nonzero(opt.state[param]["exp_avg"]) == 0


def test_the_readme_names_every_method_that_parallel_refuses() -> None:
    """The README's section on several processes named lora and relora, refused under --parallel,
    but not the methods that run under DDP only: a user found out from the error at launch."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Several processes", 1)[1].split("\n## ", 1)[0]
    said = " ".join(section.split())
    refused = [name for name, method in METHODS.items() if method.wraps_model or not method.fsdp2]
    assert refused and all(f"`{name}`" in said for name in refused), [n for n in refused if f"`{n}`" not in said]
    assert "`optim.state_dtype=int8`" in said and "`train.precision=fp16`" in said
