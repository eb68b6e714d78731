"""key=value overrides typed by the dataclass fields, and the config.json round trip."""

from __future__ import annotations

import json
import re

import pytest

from fira_train.config.overrides import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    override_keys,
    parse_value,
)
from fira_train.config.run_config import RunConfig, TrainConfig


def test_overrides_are_typed_by_field() -> None:
    config = apply_overrides(RunConfig(), [
        "train.steps=7", "optim.lr=3e-3", "optim.betas=0.9,0.95", "train.tensorboard=false",
        "train.micro_batch_size=none", "model.num_key_value_heads=2", "data.source=/tmp/x",
        "optim.relora_every=4",
    ])
    assert config.train.steps == 7
    assert config.optim.lr == pytest.approx(3e-3)
    assert config.optim.betas == (0.9, 0.95)
    assert config.train.tensorboard is False
    assert config.train.micro_batch_size is None
    assert config.model.num_key_value_heads == 2
    assert config.data.source == "/tmp/x"
    assert config.recipe == RunConfig().recipe
    # the input is left unchanged
    assert RunConfig().train.steps == TrainConfig().steps


def test_recipe_is_not_an_override() -> None:
    """recipe=NAME would only relabel the config (every field stays the old recipe's): refused."""
    from fira_train.config.recipes import micro

    with pytest.raises(ValueError, match=r"recipe=tiny is not an override.*--recipe tiny"):
        apply_overrides(micro(), ["recipe=tiny"])
    with pytest.raises(ValueError, match="--recipe"):
        apply_overrides(micro(), {"recipe": "tiny"})


def test_recipe_override_on_the_command_line_is_a_one_line_error(tmp_path, capsys) -> None:
    from fira_train.cli import main

    argv = ["pretrain", "--recipe", "micro", "--method", "fira", "--out", str(tmp_path / "r"), "recipe=tiny",
            f"data.cache_dir={tmp_path / 'cache'}", "data.source=" + str(tmp_path / "no-corpus")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "recipe=tiny is not an override" in err and "--recipe tiny" in err and "Traceback" not in err


def test_overrides_revalidate() -> None:
    with pytest.raises(ValueError, match="train.steps"):
        apply_overrides(RunConfig(), ["train.steps=-3"])


@pytest.mark.parametrize("item", ["train.stepz=3", "trainer.steps=3", "steps=3", "optim.=1"])
def test_unknown_override_keys_are_rejected(item: str) -> None:
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(RunConfig(), [item])


def test_unknown_key_lists_valid_keys_of_section() -> None:
    with pytest.raises(ValueError) as err:
        apply_overrides(RunConfig(), ["optim.rnak=4"])
    assert "optim.rank" in str(err.value)


@pytest.mark.parametrize("item", ["train.steps=ten", "optim.lr=fast", "train.tensorboard=maybe",
                                  "optim.betas=0.9", "train.steps=1.5"])
def test_unparsable_values_name_the_key(item: str) -> None:
    key = item.split("=")[0]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        apply_overrides(RunConfig(), [item])



def test_a_tuple_that_cannot_be_parsed_says_how_many_values_it_takes() -> None:
    """The message said 'as tuple': neither that betas takes two numbers nor how to write them."""
    for item in ("optim.betas=0.9", "optim.betas=0.9,0.999,1", "optim.betas=0.9;0.999"):
        with pytest.raises(ValueError, match=re.escape(f"cannot parse {item.replace('=', '=' + chr(39))}' as 2 "
                                                       "comma-separated values (float, float)")):
            apply_overrides(RunConfig(), [item])

def test_override_without_equals_sign() -> None:
    with pytest.raises(ValueError, match="section.field=value"):
        apply_overrides(RunConfig(), ["train.steps"])


def test_parse_value_bools_and_optionals() -> None:
    assert parse_value("k", "YES", bool) is True
    assert parse_value("k", "0", bool) is False
    assert parse_value("k", "null", int | None) is None
    assert parse_value("k", "12", int | None) == 12


def test_dict_round_trip_through_json() -> None:
    config = apply_overrides(RunConfig(), ["optim.betas=0.8,0.9", "train.micro_batch_size=128"])
    again = config_from_dict(json.loads(json.dumps(config_to_dict(config))))
    assert again == config
    assert isinstance(again.optim.betas, tuple)


def test_from_dict_rejects_unknown_keys() -> None:
    values = config_to_dict(RunConfig())
    values["train"]["learning_rate"] = 1.0
    with pytest.raises(ValueError, match="train.learning_rate"):
        config_from_dict(values)
    with pytest.raises(ValueError, match="unknown config key extra"):
        config_from_dict({**config_to_dict(RunConfig()), "extra": 1})


def test_override_keys_cover_every_section() -> None:
    keys = override_keys()
    for key in ("model.hidden_size", "optim.rank", "optim.update_proj_gap", "data.seq_len",
                "train.steps", "train.batch_size", "train.micro_batch_size", "train.seed"):
        assert key in keys


def test_an_override_given_twice_with_two_values_is_refused_naming_both() -> None:
    """The later one replaced the earlier silently: `... train.steps=1000 ... train.steps=10` trained 10."""
    from fira_train.config.overrides import apply_command_line
    from fira_train.config.recipes import micro

    with pytest.raises(ValueError, match=r"^train.steps is given twice, by the overrides 'train.steps=1000' and "
                                         r"'train.steps=10': give it once$"):
        apply_command_line(micro(), {}, ["train.steps=1000", "optim.lr=0.1", "train.steps=10"])
    with pytest.raises(ValueError, match="optim.betas is given twice"):
        apply_command_line(micro(), {}, ["optim.betas=0.9,0.95", "optim.betas=0.9,0.99"])
    # the same value twice (as the field reads it) changes nothing: taken
    config = apply_command_line(micro(), {}, ["train.steps=5", "optim.betas=0.9,0.95", "train.steps=05",
                                              "optim.betas=0.9, 0.950", "data.cache_dir=none", "data.cache_dir=None"])
    assert config.train.steps == 5 and config.optim.betas == (0.9, 0.95) and config.data.cache_dir is None
    with pytest.raises(ValueError, match="cannot parse train.steps='x'"):  # a bad value: apply_overrides says so
        apply_command_line(micro(), {}, ["train.steps=x", "train.steps=x"])
