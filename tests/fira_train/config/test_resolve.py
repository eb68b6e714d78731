"""fira_train.config.resolve: tuned learning rates, sign alignment, and saved configs read back."""

from __future__ import annotations

import pytest

from fira_train.config.overrides import apply_overrides, config_to_dict
from fira_train.config.recipes import TUNED_LR, micro, tiny
from fira_train.config.resolve import (
    resolved,
    resolved_align_signs,
    resolved_lr,
    saved_config,
)
from fira_train.methods.registry import get_method


def _tiny(*overrides: str):
    return apply_overrides(tiny(), list(overrides))


def test_a_recipe_s_tuned_rate_is_used_unless_optim_lr_is_set() -> None:
    assert resolved_lr(_tiny()) == TUNED_LR["tiny"]["fira"] == 0.02
    assert resolved_lr(_tiny("optim.method=adamw")) == TUNED_LR["tiny"]["adamw"]
    assert resolved_lr(_tiny("optim.method=galore")) == TUNED_LR["tiny"]["galore"]
    assert resolved_lr(_tiny("optim.lr=0.005")) == 0.005
    # a method the sweep did not tune keeps its default; so does every method of another recipe
    assert resolved_lr(_tiny("optim.method=apollo")) == get_method("apollo").default_lr
    assert resolved_lr(micro()) == get_method("fira").default_lr == 0.01


def test_every_tuned_method_exists() -> None:
    for lrs in TUNED_LR.values():
        for method, lr in lrs.items():
            assert get_method(method).name == method and lr > 0


def test_align_signs_resolves_to_raw_signs_for_the_fira_variants_only() -> None:
    assert resolved_align_signs(_tiny()) is False
    assert resolved_align_signs(_tiny("optim.method=galore")) is False
    assert resolved_align_signs(_tiny("optim.method=fira-released")) is False
    assert resolved_align_signs(_tiny("optim.align_signs=true")) is True
    assert resolved_align_signs(_tiny("optim.method=adamw")) is None  # not an option of AdamW
    run = resolved(_tiny("optim.method=galore"))
    assert (run.optim.lr, run.optim.align_signs) == (0.02, False)


@pytest.mark.parametrize("recorded", ["missing", None])
def test_a_config_saved_while_aligned_signs_were_the_default_reads_as_aligned(recorded) -> None:
    values = config_to_dict(tiny())
    if recorded == "missing":
        del values["optim"]["align_signs"]
    else:
        values["optim"]["align_signs"] = recorded
    assert saved_config(values).optim.align_signs is True
    values["optim"]["method"] = "fira-released"  # its variant always fixed raw signs
    assert saved_config(values).optim.align_signs is False
    values["optim"]["method"] = "adamw"
    assert saved_config(values).optim.align_signs is None
    # without train.parallel too: saved before sign alignment existed, by raw signs
    values["optim"]["method"] = "fira"
    del values["train"]["parallel"]
    assert saved_config(values).optim.align_signs is False


def test_a_relora_config_recorded_unresolved_reads_as_the_schedule_it_ran() -> None:
    """Before 2026-11-28 a ReLoRA run recorded relora_every / relora_rewarmup as None, meaning a
    quarter of the run and 2% of a cycle; the default re-warm-up is 10 steps since, so such a
    run is not reused (or resumed) as one of today's default."""
    config = _tiny("optim.method=relora")
    today = resolved(config)
    assert (today.optim.relora_every, today.optim.relora_rewarmup) == (75, 10)  # recorded resolved
    assert config.optim.relora_rewarmup is None
    old = config_to_dict(today)  # as such a run recorded it: lr resolved, the schedule not
    old["optim"].update(relora_every=None, relora_rewarmup=None)
    then = saved_config(old)
    assert (then.optim.relora_every, then.optim.relora_rewarmup) == (75, 1)
    assert saved_config(config_to_dict(today)) == today
    assert then != today and saved_config(config_to_dict(resolved(_tiny("optim.method=relora",
                                                                        "optim.relora_rewarmup=1")))) == then
    # a re-warm-up that was given, with the default cycle: only the cycle is filled in
    old["optim"].update(relora_every=None, relora_rewarmup=5)
    given = resolved(_tiny("optim.method=relora", "optim.relora_rewarmup=5"))
    assert (given.optim.relora_every, given.optim.relora_rewarmup) == (75, 5)
    assert saved_config(old) == given


def test_a_recorded_choice_is_read_as_recorded() -> None:
    values = config_to_dict(resolved(tiny()))
    assert values["optim"]["align_signs"] is False
    assert saved_config(values) == resolved(tiny())


def test_a_config_saved_before_state_rounding_reads_as_rounded_to_nearest() -> None:
    saved = config_to_dict(resolved(tiny()))
    assert saved["optim"].pop("state_rounding") == "nearest"
    assert saved_config(saved) == resolved(tiny())


def test_a_config_saved_before_the_test_split_keeps_its_training_data() -> None:
    saved = config_to_dict(micro())
    del saved["data"]["test_fraction"]
    assert saved_config(saved).data.test_fraction == 0.0  # every non-validation document trained
    assert micro().data.test_fraction == 0.02
