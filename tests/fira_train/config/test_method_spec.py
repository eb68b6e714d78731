"""Method specs ``NAME[@key=value...]``: parsing, refusals, and the config they build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fira_train.config.method_spec import parse_method_spec, parse_method_specs
from tests.fira_train.harness_fixtures import micro_config


def test_a_spec_is_a_method_with_its_own_overrides(tmp_path: Path) -> None:
    spec = parse_method_spec("fira@optim.step_in_backward=true@optim.state_dtype=bfloat16")
    assert spec.name == "fira" and spec.overrides == ("optim.step_in_backward=true",
                                                      "optim.state_dtype=bfloat16")
    config = spec.config(micro_config(tmp_path, "optim.lr=0.003"), tmp_path / "out")
    assert config.optim.method == "fira" and config.optim.step_in_backward is True
    assert config.optim.state_dtype == "bfloat16" and config.optim.lr == 0.003
    assert config.train.out_dir == str(tmp_path / "out" / spec.text)
    plain = parse_method_spec("adamw")
    assert plain.overrides == () and plain.config(micro_config(tmp_path), "o").train.out_dir == "o/adamw"


@pytest.mark.parametrize(("text", "message"), [
    ("@optim.rank=2", "names no method"), ("fira@rank", "not a key=value"),
    ("fira@optim.method=adamw", "do not override optim.method"),
    ("fira@train.out_dir=x", "its run's folder is OUT/<spec>"), ("fira@data.source=a/b", "no '/'"),
    ("fira@optim.rank=4@optim.rank=8", "sets optim.rank twice"), ("fira@optim.rank=4@optim.rank =8", "twice"),
])
def test_bad_specs_name_the_spec(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_method_spec(text)


def test_a_bad_override_value_names_the_key(tmp_path: Path) -> None:
    # and the spec: of several, which one holds it
    with pytest.raises(ValueError, match=r"^method spec 'fira@optim.state_dtype=int4': .*optim.state_dtype"):
        parse_method_spec("fira@optim.state_dtype=int4").config(micro_config(tmp_path), tmp_path)
    with pytest.raises(ValueError, match=r"^method spec 'fira@optim.rank=abc': cannot parse optim.rank='abc'"):
        parse_method_spec("fira@optim.rank=abc").config(micro_config(tmp_path), tmp_path)
    with pytest.raises(ValueError, match=r"optim.state_rounding='stochastic' is invalid: .*"
                                         r"'stochastic' with state_dtype='float32'"):
        parse_method_spec("fira@optim.state_rounding=stochastic").config(micro_config(tmp_path), tmp_path)


def test_stochastic_bf16_states_are_a_spec(tmp_path: Path) -> None:
    spec = parse_method_spec("fira@optim.state_dtype=bfloat16@optim.state_rounding=stochastic")
    config = spec.config(micro_config(tmp_path), tmp_path / "out")
    assert config.optim.state_dtype == "bfloat16" and config.optim.state_rounding == "stochastic"
    assert micro_config(tmp_path).optim.state_rounding == "nearest"


def test_lists_refuse_duplicates_and_emptiness() -> None:
    assert [s.text for s in parse_method_specs("fira, fira@optim.rank=2")] == ["fira", "fira@optim.rank=2"]
    with pytest.raises(ValueError, match="twice"):
        parse_method_specs("fira@optim.rank=2,fira@optim.rank=2")
    with pytest.raises(ValueError, match="at least one"):
        parse_method_specs(" ")
    for text in ("fira,,adamw", "fira,", " , "):  # a method may have been lost
        with pytest.raises(ValueError, match="empty entry"):
            parse_method_specs(text)


@pytest.mark.parametrize(("methods", "first", "second"), [
    ("fira@optim.rank=4,adamw,fira@optim.rank=04", "fira@optim.rank=4", "fira@optim.rank=04"),
    ("fira@optim.rank=4@optim.alpha=0.5,fira@optim.alpha=0.50@optim.rank=4", "fira@optim.rank=4@optim.alpha=0.5",
     "fira@optim.alpha=0.50@optim.rank=4"),
    ("galore,galore@optim.rank={rank}", "galore", "galore@optim.rank={rank}"),  # the value the command has
    ("adamw,adamw@optim.rank=3", "adamw", "adamw@optim.rank=3"),  # a setting adamw does not read
    ("fira,fira@optim.lr=0.01", "fira", "fira@optim.lr=0.01"),  # micro's tuned lr for fira
    ("galore@optim.align_signs=false,galore", "galore@optim.align_signs=false", "galore"),  # the default
])
def test_specs_that_train_the_same_run_are_refused_naming_both(methods: str, first: str, second: str,
                                                               tmp_path: Path) -> None:
    """Each was trained (or measured) once per spelling, under two labels."""
    from fira_train.config.method_spec import refuse_same_runs

    base = micro_config(tmp_path)
    methods, first, second = (text.replace("{rank}", str(base.optim.rank)) for text in (methods, first, second))
    with pytest.raises(ValueError, match="^" + re.escape(f"--methods: {first!r} and {second!r} are the same run")):
        refuse_same_runs(parse_method_specs(methods), base)


def test_specs_that_train_different_runs_are_taken(tmp_path: Path) -> None:
    from fira_train.config.method_spec import refuse_same_runs

    base = micro_config(tmp_path)
    refuse_same_runs(parse_method_specs(f"fira,fira@optim.rank={base.optim.rank + 1},galore,adamw@optim.lr=0.1,"
                                        "adamw@train.eval_every=2"), base)


def test_a_value_cut_at_a_comma_is_named_as_such() -> None:
    """``fira@optim.betas=0.9,0.95`` split into ``fira@optim.betas=0.9`` and ``0.95``: the error
    was "unknown method '0.95'" and the list of methods, which did not say why."""
    with pytest.raises(ValueError, match=r"--methods: '0\.95'.*after 'fira@optim\.betas=0\.9'.*comma.*"
                                         r"optim\.betas=") as caught:
        parse_method_specs("fira@optim.betas=0.9,0.95,adamw")
    assert "valid methods" not in str(caught.value)
    with pytest.raises(ValueError, match="unknown method 'firra'; valid methods"):  # a misspelt name stays so
        parse_method_specs("fira@optim.rank=4,firra")
