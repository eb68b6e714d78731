r"""One pre-training run: build, (resume,) train, evaluate, checkpoint, summarise.

:func:`train` is one flat loop around :func:`train_step` (which benchmarks reuse, so that
they time what a run does). Each optimizer step accumulates ``train.grad_accum``
micro-batches (each loss divided by the number of micro-batches, so the gradient is that of
the mean token loss of the whole batch), optionally clips the global gradient norm, steps the
optimizer and the warm-up + cosine schedule, and logs ``step, loss, lr, tokens_per_s``.

Validation perplexity is averaged over tokens: every validation sequence of length L gives
L - 1 next-token predictions, and

.. math::
    \mathrm{val\_loss} = \frac{\sum_{b}\sum_{i,t} \ell_{b,i,t}}{\sum_b B_b (L - 1)}, \qquad
    \mathrm{val\_ppl} = \exp(\mathrm{val\_loss})

(the released harness divides a sum of per-batch means by the number of batches plus one).

Model, method (optimizer) and schedule are built by :func:`build_training`, which applies
``train.parallel`` (DDP / FSDP2, :func:`fira_train.parallel.parallelize`) between the model and
the optimizer. Under ``torchrun`` every rank reads the same global batches and trains on its
rows of each micro-batch, the logged loss and the validation loss are reduced over the ranks,
only rank 0 writes the run's files, and checkpoints go through
:mod:`fira_train.dist_checkpoint`; the distributed-only pieces are in
:mod:`fira_train.train_parallel`. A run at any world size trains on the same global batches as
one process, to floating-point round-off.

Analyses hook into the loop through ``callbacks`` (:class:`TrainCallback`): code that must see
the gradients or the optimizer's state at every step (recording scaling factors, injecting
gradient noise) without a second training loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fira_train import checkpoint as ckpt
from fira_train.cli import is_rank_zero
from fira_train import resume_check
from fira_train import run_files
from fira_train import train_parallel
from fira_train.config import RunConfig
from fira_train.overrides import config_from_dict, config_to_dict
from fira_train.run_state import capture_state, restore_state, seed_everything
from fira_train.data import build_corpus
from fira_train.divergence import DivergedError, check_loss, diverged
from fira_train.json_files import dumps as json_dumps, read_json
from fira_train.methods import MethodSetup, build_method, get_method, resolved_lr
from fira_train.metrics import MetricsLog, PeakMemory, optimizer_state_bytes, optimizer_state_numel, perplexity
from fira_train.model import build_model, count_parameters
from fira_train.parallel import DistributedEnv, all_reduce_mean, clip_grad_norm_, parallelize, shard_batch, unwrap
from fira_train.run_lock import locked_run_directory
from fira_train.schedule import WarmupCosine

log = logging.getLogger(__name__)

#: Config keys that may differ between a run and its resumption (they do not change the
#: trajectory of the weights).
RESUMABLE_CHANGES = frozenset({
    "train.save_every", "train.keep_last", "train.eval_every", "train.progress",
    "train.tensorboard", "train.out_dir",
    # the same global batches at any world size or thread count: equal to round-off
    "train.parallel", "train.num_threads",
})


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stops before updating the weights."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite training loss {loss} at step {step}; the run stopped before "
                         "applying that step's update (lower optim.lr, enable train.grad_clip, or "
                         "resume from an earlier checkpoint)")
        self.step = step
        self.loss = loss

    def __reduce__(self) -> tuple:  # crosses process boundaries (analysis workers)
        return (type(self), (self.step, self.loss))


class TrainCallback:
    """Hooks into :func:`train`'s loop; subclasses override what they need (both default to no-ops).

    ``step`` is the number of the optimizer step being taken (1 for the first), ``loss`` that
    step's mean training loss. Callbacks are not part of the config or the checkpoint: one that
    changes the trajectory (gradient noise, optimizer options) must be recorded by its caller,
    and is re-applied, not restored, on resume.
    """

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        """After the step's gradients are accumulated in ``p.grad``, before clipping and
        ``optimizer.step()``: gradients may be read or modified here."""

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        """After ``optimizer.step()``, before the gradients are zeroed: the step's gradients
        and the optimizer state that step produced are both available."""


@dataclass
class Training:
    """Everything the loop mutates, built by :func:`build_training`."""

    setup: MethodSetup
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    parallel_model: torch.nn.Module | None = None
    """The DDP wrapper that runs the forward passes (None otherwise: FSDP2 shards the model in
    place, and ``model`` is then the FSDP2 module)."""

    @property
    def model(self) -> torch.nn.Module:
        """The model whose parameters the optimizer holds (checkpointed, seen by callbacks)."""
        return self.setup.model

    @property
    def forward_model(self) -> torch.nn.Module:
        """The module to call for the training and validation forward passes."""
        return self.parallel_model if self.parallel_model is not None else self.setup.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.setup.optimizer


def resolve_device(config: RunConfig) -> torch.device:
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available")
    if config.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.train.device)


def autocast_for(config: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA devices that support it ("auto"), or wherever "bf16" asks for it."""
    precision = config.train.precision
    if precision == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        use_bf16 = precision == "bf16"
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_training(config: RunConfig, vocab_size: int, device: torch.device,
                   env: DistributedEnv | None = None) -> Training:
    """Model (seeded random init) -> [parallelize] -> method (optimizer) -> schedule.

    With ``train.parallel`` ddp / fsdp2 (``env``: the process group's), the model is
    parallelized before the optimizer sees its parameters: FSDP2 replaces them by row-sharded
    DTensors, which the optimizer must hold; under DDP the optimizer holds the wrapped
    module's parameters and Fira-family methods deal their refresh SVDs to the ranks
    (``split_refresh``).
    """
    model = build_model(config.model, vocab_size, config.data.seq_len, config.train.seed).to(device)
    mode = config.train.parallel
    wrapped = None
    if mode != "none":
        wrapped = parallelize(model, mode, env)
        model = unwrap(wrapped)  # FSDP2: the sharded model itself
    setup = build_method(model, config, split_refresh=mode == "ddp")
    schedule = WarmupCosine(config.train.steps, config.train.warmup_fraction, config.train.min_lr_ratio,
                            restart_every=setup.restart_every, rewarmup=setup.rewarmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, schedule)
    return Training(setup, scheduler, device, wrapped if wrapped is not model else None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device,
             autocast: contextlib.AbstractContextManager,
             env: DistributedEnv | None = None) -> tuple[float, int]:
    """(mean next-token loss over all validation tokens, number of tokens).

    With a distributed ``env`` each rank evaluates its rows of every batch and the sums of
    losses and of tokens are reduced over the ranks: the same mean as one process.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for batch in batches:
        ids = batch.to(device)  # (B, L)
        counted = True
        if env is not None and env.distributed:
            ids, counted = train_parallel.eval_rows(ids, env)
        with autocast:
            logits = model(input_ids=ids).logits  # (B, L, V)
        if not counted:
            continue
        targets = ids[:, 1:]  # position t predicts token t + 1
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="sum")
        total += losses.double()
        count += targets.numel()
    model.train(was_training)
    if env is not None and env.distributed:
        total, count = train_parallel.sum_over_ranks(total, count, env)
    return (total / count).item(), count


def config_changes(old: RunConfig, new: RunConfig) -> list[str]:
    a, b = config_to_dict(old), config_to_dict(new)
    changed = []
    for section in ("model", "optim", "data", "train"):
        for key in a[section].keys() | b[section].keys():
            if a[section].get(key) != b[section].get(key):
                changed.append(f"{section}.{key}")
    return sorted(k for k in changed if k not in RESUMABLE_CHANGES)


def _prepare_out_dir(config: RunConfig, out: Path, resume: str | int | None, overwrite: bool,
                     delete: bool = True) -> None:
    """Check that OUT may hold this run; with ``overwrite`` (and ``delete``: rank 0 only)
    remove a previous one. Files fira-train did not write are never deleted, and refused
    without ``overwrite`` (:func:`fira_train.run_files.check_foreign_files`)."""
    run_files.check_foreign_files(out, resume, overwrite)
    previous = [p for p in ("metrics.jsonl", "summary.json", ckpt.CHECKPOINT_DIR) if (out / p).exists()]
    if resume is None and previous:
        if not overwrite:
            raise FileExistsError(f"{str(out)!r} already holds a run ({', '.join(previous)}); pass "
                                  "--resume to continue it or --overwrite to start over")
        for name in ("metrics.jsonl", "summary.json", "config.json", "tb", ckpt.CHECKPOINT_DIR):
            path = out / name
            if delete and path.is_dir():
                shutil.rmtree(path)
            elif delete and path.exists():
                path.unlink()
    if resume is not None and (out / "config.json").exists():
        saved = config_from_dict(read_json(out / "config.json", hint="restore it, or delete it and resume "
                                           "with the command line that started the run"))
        changes = config_changes(saved, config)
        if changes:
            raise ValueError(f"cannot resume {str(out)!r} with a different config: {', '.join(changes)} "
                             "differ from its config.json (resuming must reproduce the same run)")


def train(config: RunConfig, *, resume: str | int | None = None, overwrite: bool = False,
          corpus: Any = None, callbacks: Sequence[TrainCallback] = ()) -> dict[str, Any]:
    """Run (or resume) ``config``; returns the summary also written to ``OUT/summary.json``.

    ``resume``: None (fresh run; an existing run in OUT is an error unless ``overwrite``),
    ``"latest"`` (continue from the newest complete checkpoint, or start fresh if there is
    none) or a step number (that checkpoint; FileNotFoundError if absent). ``corpus`` lets
    several runs share one tokenised corpus (``compare``). ``callbacks`` are called in order
    at every step (:class:`TrainCallback`).

    With ``train.parallel`` ddp / fsdp2, every process of a ``torchrun`` launch calls this
    (:mod:`fira_train.train_parallel`); every rank returns the summary, rank 0 writes it.
    """
    config = replace(config, optim=replace(config.optim, lr=resolved_lr(config)))
    get_method(config.optim.method)
    # before the lock file is created: nothing is added to a folder the run may not use
    run_files.check_foreign_files(config.train.out_dir, resume, overwrite, warn=False)
    if config.train.parallel == "none":
        train_parallel.check_launch(config)
        with locked_run_directory(config.train.out_dir):  # one run at a time per OUT
            return _train(config, None, resume, overwrite, corpus, callbacks)
    with train_parallel.distributed_session(config) as env:
        with locked_run_directory(config.train.out_dir, env):
            return _train(config, env, resume, overwrite, corpus, callbacks)


def train_step(training: Training, config: RunConfig, stream: Iterator[torch.Tensor],
               autocast: contextlib.AbstractContextManager, step: int, *,
               env: DistributedEnv | None = None, callbacks: Sequence[TrainCallback] = (),
               trainable: list[torch.nn.Parameter] | None = None) -> tuple[float, float]:
    """Optimizer step number ``step`` (1-based) as ``fira-train`` runs it; returns ``(loss,
    seconds after the backward passes)``.

    ``train.grad_accum`` micro-batches from ``stream`` forward and backward (each rank its rows
    under ``env``), the mean loss (raises :class:`NonFiniteLossError` before anything is
    updated if it is not finite, :class:`~fira_train.divergence.DivergedError` if it is above
    the divergence bound), callbacks, gradient clipping, the optimizer, the schedule,
    the method's ``after_step`` (ReLoRA's merges). The second number times the part that
    differs between methods (from the callbacks on): ``benchmarks/throughput.py`` reports it.
    """
    distributed = env is not None
    net, model, optimizer = training.forward_model, training.model, training.optimizer
    device = training.device
    accum = config.train.grad_accum
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        ids = next(stream).to(device)  # (micro_batch, seq_len), the same on every rank
        if distributed:
            ids = shard_batch(ids, env)  # this rank's micro_batch / world_size rows
        with train_parallel.accumulation_context(net, last=micro == accum - 1):
            with autocast:
                loss = net(input_ids=ids, labels=ids).loss  # mean over micro_batch * (seq_len - 1)
            (loss / accum).backward()
        loss_sum += loss.detach()
    # equal rows per rank: the mean of the ranks' means is the global mean
    step_loss = all_reduce_mean(loss_sum / accum, env) if distributed else (loss_sum / accum).item()
    if not math.isfinite(step_loss):
        raise NonFiniteLossError(step, step_loss)
    check_loss(step, step_loss)  # a loss above the divergence bound (fira_train.divergence)
    started = time.perf_counter()
    for callback in callbacks:
        callback.before_step(step, model, optimizer, step_loss)
    if config.train.grad_clip > 0:
        if trainable is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
        clip_grad_norm_(trainable, config.train.grad_clip)  # the global norm over FSDP2's shards too
    optimizer.step()
    for callback in callbacks:
        callback.after_step(step, model, optimizer, step_loss)
    training.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if training.setup.after_step is not None:
        training.setup.after_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step_loss, time.perf_counter() - started


def _train(config: RunConfig, env: DistributedEnv | None, resume: str | int | None, overwrite: bool,
           corpus: Any, callbacks: Sequence[TrainCallback]) -> dict[str, Any]:
    """:func:`train`'s body; ``env`` is None for one process, the process group's otherwise."""
    distributed = env is not None
    out = Path(config.train.out_dir)
    main = env.is_main if distributed else is_rank_zero()
    _prepare_out_dir(config, out, resume, overwrite, delete=main or not distributed)
    if distributed:
        dist.barrier()  # every rank has checked OUT before rank 0 rewrites config.json

    state, resume_path = None, None
    if resume is not None:
        # the newest intact checkpoint (or the one asked for), verified, of this config: chosen
        # before config.json is rewritten, so that a refused resume leaves the run as it was
        path, state = resume_check.choose_checkpoint(out, resume, config, env)
        if path is None:
            log.info("no complete checkpoint in %s: starting from step 0", out)
        elif state is None:
            resume_path = path  # loaded into the built model (DCP loads in place)
        if main:
            ckpt.remove_partial(out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")

    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    seed_everything(config.train.seed)
    device = env.device if distributed else resolve_device(config)
    autocast = autocast_for(config, device)
    if corpus is None:
        corpus = build_corpus(config.data)
    training = build_training(config, corpus.vocab_size, device, env)
    model, optimizer = training.model, training.optimizer
    net = training.forward_model  # the DDP wrapper, else the model
    micro_batch = config.train.micro_batch_size or config.train.batch_size
    if distributed and micro_batch % env.world_size:
        raise ValueError(f"train.micro_batch_size={micro_batch} (the sequences of one forward pass) "
                         f"must divide by the {env.world_size} processes: each trains on its rows")
    stream = corpus.train_batches(micro_batch, config.train.seed)
    val_batches = corpus.val_batches(micro_batch)

    step, progress = 0, {"tokens": 0, "train_time_s": 0.0}
    restored = state is not None
    if restored:
        step, progress = restore_state(state, training, stream)
        log.info("resumed %s from step %d", out, step)
    elif resume_path is not None:
        step, progress = train_parallel.load(out, resume_path, training, stream, config.train.parallel)
        log.info("resumed %s from step %d (%s)", out, step, resume_path.name)
    del state
    metrics = MetricsLog(out, tensorboard=config.train.tensorboard and main,
                         resume_step=step if resume is not None else None) if main else None

    t = config.train
    tokens_per_step = t.batch_size * config.data.seq_len
    trainable = [p for p in model.parameters() if p.requires_grad]
    memory = PeakMemory(device)
    memory.reset()
    val_loss = float("nan")
    run_start = time.perf_counter()

    from tqdm.auto import tqdm

    bar = tqdm(total=t.steps, initial=step, desc=config.optim.method, unit="step",
               disable=not (t.progress and main), dynamic_ncols=True)
    net.train()
    while step < t.steps:
        started = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        try:
            step_loss, _ = train_step(training, config, stream, autocast, step + 1, env=env,
                                      callbacks=callbacks, trainable=trainable)
        except (NonFiniteLossError, DivergedError):
            bar.close()
            raise
        step += 1
        elapsed = time.perf_counter() - started
        progress["tokens"] += tokens_per_step
        progress["train_time_s"] += elapsed

        record = {"step": step, "loss": step_loss, "lr": lr, "tokens_per_s": tokens_per_step / elapsed,
                  "tokens": progress["tokens"]}
        if step == t.steps or (t.eval_every and step % t.eval_every == 0):
            val_loss, _ = evaluate(net, val_batches, device, autocast, env)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
        if metrics is not None:
            metrics.log(record)
        if "val_loss" in record and diverged(val_loss):  # before a checkpoint keeps the weights
            bar.close()
            raise DivergedError(step, val_loss, "validation loss")
        bar.update(1)
        bar.set_postfix({k: f"{record[k]:.4g}" for k in ("loss", "lr", "tokens_per_s", "val_ppl") if k in record})
        if step == t.steps or (t.save_every and step % t.save_every == 0):
            if distributed:  # every rank writes its shards
                train_parallel.save(out, step, training, stream, progress, t.keep_last,
                                    record={resume_check.CONFIG_KEY: config_to_dict(config)})
            elif main:
                ckpt.save_checkpoint(out, step, capture_state(step, training, stream, progress)
                                     | {resume_check.CONFIG_KEY: config_to_dict(config)})
                ckpt.prune_checkpoints(out, t.keep_last)
    bar.close()

    if math.isnan(val_loss):  # resumed at the final step: evaluate the restored weights
        val_loss, _ = evaluate(net, val_batches, device, autocast, env)
        check_loss(step, val_loss, "validation loss")
    summary = {
        "recipe": config.recipe,
        "method": config.optim.method,
        "rank": config.optim.rank if get_method(config.optim.method).uses_rank else None,
        "update_proj_gap": config.optim.update_proj_gap,
        "lr": config.optim.lr,
        "steps": step,
        "tokens": progress["tokens"],
        "seed": t.seed,
        "parameters": count_parameters(model),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "val_loss": val_loss,
        "val_ppl": perplexity(val_loss),
        "val_tokens": sum(b[:, 1:].numel() for b in val_batches),
        "tokens_per_s": progress["tokens"] / max(progress["train_time_s"], 1e-9),
        "train_time_s": progress["train_time_s"],
        "wall_time_s": time.perf_counter() - run_start,
        "optimizer_state_numel": optimizer_state_numel(optimizer),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_memory_bytes": memory.peak_bytes(),
        "peak_memory_kind": memory.kind,
        "device": str(device),
        "data": corpus.describe(),
    }
    if distributed:  # peak memory is rank 0's
        summary.update(parallel=t.parallel, world_size=env.world_size)
    if metrics is not None:
        metrics.close()
    if main:
        (out / "summary.json").write_text(json_dumps(summary, indent=2) + "\n")
    return summary
