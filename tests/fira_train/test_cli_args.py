"""The command line's parsers: overrides among the flags, and each stored flag given once."""

from __future__ import annotations

import argparse

import pytest

from fira_train.cli import build_parser
from fira_train.cli_args import StoreOnce


def _parsers(parser: argparse.ArgumentParser, name: str = "fira-train") -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every sub-command's parser below it, with its command line's words."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                found += _parsers(sub, f"{name} {command}")
    return found


def test_every_stored_flag_of_every_command_takes_one_value() -> None:
    """argparse's store kept the last of two values silently: `--recipe 60m ... --recipe tiny` trained tiny."""
    flags = [(name, action.option_strings[0]) for name, parser in _parsers(build_parser())[1:]
             for action in parser._actions if action.option_strings and isinstance(action, argparse._StoreAction)]
    assert ("fira-train pretrain", "--recipe") in flags and ("fira-train finetune", "--threads") in flags
    assert ("fira-train analyze noise", "--steps") in flags
    plain = [(name, flag) for name, parser in _parsers(build_parser())[1:] for action in parser._actions
             if action.option_strings and type(action) is argparse._StoreAction
             for flag in action.option_strings[:1]]
    assert plain == []


@pytest.mark.parametrize(("argv", "said"), [
    (["pretrain", "--recipe", "micro", "--method", "fira", "--recipe", "tiny"], "argument --recipe: given twice "
     "(--recipe 'micro', then --recipe 'tiny'); give it once"),
    (["pretrain", "--recipe", "micro", "--method", "fira", "--method", "adamw"], "argument --method: given twice "
     "(--method 'fira', then --method 'adamw')"),
    (["compare", "--recipe", "micro", "--methods", "fira", "--steps", "7", "--steps", "9"],
     "argument --steps: given twice (--steps 7, then --steps 9)"),
    (["sweep", "--out", "a", "--out", "b"], "argument --out: given twice (--out 'a', then --out 'b')"),
    (["memory", "--measure", "--steps", "2", "--steps", "3"], "argument --steps: given twice"),
    (["analyze", "gap-sweep", "--methods", "fira,galore", "--methods", "fira"],
     "argument --methods: given twice (--methods 'fira,galore', then --methods 'fira')"),
    (["finetune", "--tasks", "boolq", "--data-dir", "d", "--threads", "1", "--threads", "2"],
     "argument --threads: given twice (--threads 1, then --threads 2)"),
    (["compare", "--recipe", "micro", "--methods", "fira", "--methods", "adamw"],
     "give it once, with every value in one comma-separated list"),  # its help says comma-separated
])
def test_a_flag_given_twice_with_two_values_is_refused_naming_both(argv: list[str], said: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert said in capsys.readouterr().err


def test_the_same_value_twice_and_repeatable_flags_are_taken() -> None:
    parser = build_parser()
    args = parser.parse_args(["pretrain", "--recipe", "micro", "--method", "fira", "--steps", "3", "train.seed=1",
                              "--steps", "03", "train.batch_size=4"])
    assert args.steps == 3 and args.overrides == ["train.seed=1", "train.batch_size=4"]
    assert not any(name.startswith("_") for name in vars(args))  # the parse's bookkeeping is not an argument
    args = parser.parse_args(["sweep", "--out", "o", "--lrs", "0.1", "--lrs", "adamw:0.2"])
    assert args.lrs == ["0.1", "adamw:0.2"]  # --lrs repeats by design (append)
    args = parser.parse_args(["analyze", "noise", "--steps", "2", "train.seed=1"])
    assert args.steps == 2 and not any(name.startswith("_") for name in vars(args))


def test_store_once_is_the_stored_action_of_argument_groups_too() -> None:
    from fira_train.cli_args import IntermixedArgumentParser

    parser = IntermixedArgumentParser(prog="p")
    parser.add_argument_group("g").add_argument("--x")
    assert isinstance(parser._actions[-1], StoreOnce)
    with pytest.raises(SystemExit):
        parser.parse_args(["--x", "1", "--x", "2"])
