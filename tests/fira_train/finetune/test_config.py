"""The fine-tuning methods are a view of the method registry."""

from __future__ import annotations

import pytest

from fira_train.finetune.config import DEFAULT_LR, METHODS, REGISTRY_METHODS, FinetuneConfig, FinetuneError
from fira_train.methods.registry import METHODS as REGISTRY


def test_finetune_methods_are_registry_entries_plus_none_and_fira_lora() -> None:
    assert set(REGISTRY_METHODS) <= set(REGISTRY)
    assert set(METHODS) - set(REGISTRY_METHODS) == {"none", "fira-lora"}
    assert set(DEFAULT_LR) == set(METHODS)


def test_defaults_score_by_loglik_on_500_examples_per_task() -> None:
    import argparse

    from fira_train.finetune.cli import config_from_args, register
    from fira_train.finetune.config import FinetuneConfig

    config = FinetuneConfig(tasks=["boolq"], data_dir=".")
    assert config.scoring == "loglik" and config.max_eval == 500 and config.method == "fira"
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["finetune", "--tasks", "boolq", "--data-dir", "."])
    cli = config_from_args(args)
    assert cli.scoring == "loglik" and cli.max_eval == 500 and cli.method == "fira" and cli.recipe is None
    args = parser.parse_args(["finetune", "--tasks", "boolq", "--data-dir", ".", "--max-eval", "all",
                              "--scoring", "generate"])
    assert config_from_args(args).max_eval is None and config_from_args(args).scoring == "generate"


def test_released_recipe_is_fira_rank_16_on_lora_r_32_at_lr_1e_4() -> None:
    import pytest

    from fira_train.finetune.config import FinetuneConfig, FinetuneError

    config = FinetuneConfig(tasks=["boolq"], data_dir=".", recipe="released")
    assert (config.method, config.effective_lr, config.effective_rank) == ("fira-lora", 1e-4, 16)
    assert (config.lora_r, config.lora_alpha, config.alpha, config.update_proj_gap) == (32, 64, 1.0, 200)
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", recipe="released", method="fira-lora", lr=1e-4).lr == 1e-4
    for extra, message in (({"lr": 3e-4}, "recipe='released' fixes lr=0.0001, but lr=0.0003 was given"),
                           ({"method": "fira"}, "fixes method='fira-lora', but method='fira'"),
                           ({"lora_r": 8}, "fixes lora_r=32, but lora_r=8")):
        with pytest.raises(FinetuneError, match=message):
            FinetuneConfig(tasks=["boolq"], data_dir=".", recipe="released", **extra)
    with pytest.raises(FinetuneError, match="recipe='paper' must be one of released"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", recipe="paper")
    with pytest.raises(FinetuneError, match="scoring='bleu' must be one of loglik, generate"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", scoring="bleu")


def test_the_results_record_only_the_options_a_method_uses() -> None:
    """--rank 8 --alpha 0.5 given to adamw trained plain AdamW: results.json said rank 8, alpha 0.5."""
    adamw = FinetuneConfig(tasks=["boolq"], data_dir=".", method="adamw", rank=8, alpha=0.5, steps=2)
    assert set(adamw.used_options().values()) == {None}
    lora = FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira-lora", steps=2, rank=4, lora_r=8)
    used = lora.used_options()
    assert (used["rank"], used["lora_r"], used["target_modules"]) == (4, 8, None)  # its targets: the adapters
    fira = FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", steps=2)
    assert fira.used_options()["rank"] == 32 and fira.used_options()["lora_r"] is None
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", steps=0).used_options()["rank"] is None
    # nothing trained: no steps, and no training option describes the run (it recorded 100 x 8)
    for zero_shot in (FinetuneConfig(tasks=["boolq"], data_dir=".", method="none", batch_size=4),
                      FinetuneConfig(tasks=["boolq"], data_dir=".", method="adamw", steps=0, max_train=9)):
        used = zero_shot.used_options()
        assert used["steps"] == 0 and used["batch_size"] is None and used["max_train"] is None
        assert used["save_steps"] is None and used["weight_decay"] is None


def test_the_fira_memory_options_are_checked_before_anything_loads() -> None:
    import pytest

    from fira_optim.options import STATE_DTYPES as LIBRARY_STATE_DTYPES
    from fira_train.finetune.config import STATE_DTYPES, FinetuneError

    assert STATE_DTYPES == tuple(LIBRARY_STATE_DTYPES)
    with pytest.raises(FinetuneError, match=r"precision='fp8' must be one of fp32, bf16, fp16"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", precision="fp8")
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="none", precision="bf16").used_options()[
        "precision"] is None  # zero-shot: nothing trains at any precision
    with pytest.raises(FinetuneError, match=r"state_dtype='int4' must be one of float32, bfloat16, int8"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", state_dtype="int4")
    with pytest.raises(FinetuneError, match=r"step_in_backward=True is an option of the Fira-family methods "
                                            r"\(galore, fira, fira-lora\), not of method='adamw'"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="adamw", step_in_backward=True)
    with pytest.raises(FinetuneError, match="state_dtype='int8' is an option of the Fira-family"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="lora", state_dtype="int8")
    used = FinetuneConfig(tasks=["boolq"], data_dir=".", method="galore", step_in_backward=True,
                          state_dtype="bfloat16").used_options()
    assert used["step_in_backward"] is True and used["state_dtype"] == "bfloat16"
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="adamw").used_options()["state_dtype"] is None


def test_state_rounding_is_checked_with_the_state_dtype_it_needs() -> None:
    import pytest

    from fira_optim.options import STATE_ROUNDINGS as LIBRARY_STATE_ROUNDINGS

    from fira_train.finetune.config import STATE_ROUNDINGS, FinetuneError

    assert STATE_ROUNDINGS == tuple(LIBRARY_STATE_ROUNDINGS)
    with pytest.raises(FinetuneError, match=r"state_rounding='up' must be one of nearest, stochastic"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", state_dtype="bfloat16", state_rounding="up")
    with pytest.raises(FinetuneError, match=r"state_rounding='stochastic' .* needs state_dtype='bfloat16', "
                                            r"not state_dtype='int8'"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", state_dtype="int8", state_rounding="stochastic")
    used = FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", state_dtype="bfloat16",
                          state_rounding="stochastic").used_options()
    assert used["state_rounding"] == "stochastic"
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="adamw").used_options()["state_rounding"] is None


def test_a_thread_count_the_process_cannot_start_is_refused() -> None:
    """--threads 100000 crashed the interpreter (a segmentation fault); the cap is train.num_threads's."""
    import pytest

    from fira_train.config.run_config import MAX_THREADS as RUN_MAX_THREADS
    from fira_train.finetune.config import MAX_THREADS, FinetuneError

    assert MAX_THREADS == RUN_MAX_THREADS
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", threads=MAX_THREADS).threads == MAX_THREADS
    for value in (100000, 0):
        with pytest.raises(FinetuneError, match=rf"^threads={value} must be an integer in \[1, 1024\]$"):
            FinetuneConfig(tasks=["boolq"], data_dir=".", threads=value)


def test_max_eval_zero_points_to_all_not_to_the_default() -> None:
    """It said "leave it out to evaluate every example": left out, --max-eval is 500."""
    with pytest.raises(FinetuneError) as refused:
        FinetuneConfig(tasks=["boolq"], data_dir="d", max_eval=0)
    assert "--max-eval all" in str(refused.value) and "leave it out" not in str(refused.value)


def test_flags_a_run_does_not_use_are_named() -> None:
    """A zero-shot run given --state-dtype int8 and --lr, or LoRA given Fira's --alpha, went on
    without a word: the flags changed nothing."""
    zero_shot = FinetuneConfig(tasks=["boolq"], data_dir=".", method="none", state_dtype="int8", lr=0.1, batch_size=4)
    assert zero_shot.unused_flags() == ["--state-dtype", "--batch-size", "--lr"]
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="lora", alpha=0.5).unused_flags() == ["--alpha"]
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="fira", alpha=0.5, lr=0.1).unused_flags() == []
    assert FinetuneConfig(tasks=["boolq"], data_dir=".", method="none").unused_flags() == []  # defaults: nothing typed


def test_an_out_that_is_the_data_folder_or_a_tasks_folder_is_refused(tmp_path) -> None:
    """--out given the data folder (the flags swapped): the run wrote results.json, predictions/
    and its Trainer checkpoints among the task sets, also into a read-only shared folder as root."""
    data = tmp_path / "commonsense"
    (data / "boolq").mkdir(parents=True)
    for out, what in ((data, "the data folder"), (data / "boolq", "the folder of task 'boolq' in the data"),
                      (tmp_path / "link", "the data folder")):
        if out.name == "link":
            out.symlink_to(data)
        with pytest.raises(FinetuneError, match=rf"^out='{out}' is {what} \(data_dir='{data}'\): .*choose an "
                                                r"--out outside it$"):
            FinetuneConfig(tasks=["boolq"], data_dir=str(data), out=str(out))
    # a task's folder that is a link to its set elsewhere: the same folder, by either path
    (tmp_path / "sets" / "piqa").mkdir(parents=True)
    (data / "piqa").symlink_to(tmp_path / "sets" / "piqa")
    for out in (data / "piqa", tmp_path / "sets" / "piqa"):
        with pytest.raises(FinetuneError, match=rf"^out='{out}' is the folder of task 'piqa' in the data "):
            FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), out=str(out))
    # beside the data, or a folder of its own inside it, is a run's folder like any other
    for out in (tmp_path / "run", data / "runs" / "fira", data / "winogrande"):
        assert FinetuneConfig(tasks=["boolq"], data_dir=str(data), out=str(out)).out_dir == out


def test_module_names_that_select_nothing_whatever_the_model_are_refused_before_it_loads() -> None:
    """A --target-modules regex that does not compile, and a --target-modules or --lora-targets
    that lists no name, were refused only once the model had loaded (a long load on a real model).
    Names that match no module of the model need the model: they are checked then. An option the
    method does not use is not checked (a warning names it)."""
    common = dict(tasks=["boolq"], data_dir=".")
    for method in ("fira", "galore", "apollo"):
        with pytest.raises(FinetuneError, match=r"^target_modules='\[': not a valid regular expression \(unterminated"):
            FinetuneConfig(**common, method=method, target_modules="[")
        with pytest.raises(FinetuneError, match=r"^target_modules=' , ' names no module: give all-linear"):
            FinetuneConfig(**common, method=method, target_modules=" , ")
    for method in ("lora", "fira-lora"):
        with pytest.raises(FinetuneError, match=r"^lora_targets=',' names no module: give a comma list"):
            FinetuneConfig(**common, method=method, lora_targets=",")
    for kept in (dict(method="lora", target_modules="["), dict(method="fira", lora_targets=","),
                 dict(method="none", target_modules="["), dict(target_modules=r"model\..*\.(q|v)_proj"),
                 dict(target_modules="all_linear"), dict(target_modules="q_proj,v_prj")):
        FinetuneConfig(**common, **kept)
