"""Fine-tuning one model with one method through the Hugging Face ``Trainer`` (Fira and GaLore through
:class:`fira_optim.integrations.FiraTrainer`), measuring time, loss, optimizer state and peak memory."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import transformers

from fira_optim import optimizer_state_numel
from fira_optim.integrations import FiraTrainer
from fira_train.finetune.config import FIRA_METHODS, LORA_METHODS, FinetuneConfig, FinetuneError
from fira_train.finetune.data import PaddingCollator, tokenize_for_training
from fira_train.run.peak_memory import reset_rss_peak, rss_peak_bytes


def prepare_model(model: torch.nn.Module, config: FinetuneConfig) -> torch.nn.Module:
    """``model``, wrapped in ``peft`` LoRA adapters for the LoRA methods."""
    if config.effective_method not in LORA_METHODS:
        return model
    import peft  # only the LoRA methods need it, and it takes seconds to import

    targets = [t.strip() for t in config.lora_targets.split(",") if t.strip()]
    lora = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as err:
        raise FinetuneError(f"lora_targets={config.lora_targets!r} do not fit the model: {err}") from None


def train_model(model: torch.nn.Module, tokenizer: Any, train: list[dict], config: FinetuneConfig) -> dict[str, Any]:
    """Train ``model`` (prepared by :func:`prepare_model`) on the ``train`` records with
    ``config``'s method; returns time, steps, losses, optimizer-state size and peak memory."""
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
    reset = reset_rss_peak()
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
        "train_peak_rss_mib": (rss_peak_bytes() or 0) / 2**20 if reset else None,
        "train_peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }
