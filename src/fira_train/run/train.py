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

Model, method (optimizer) and schedule are built by
:func:`fira_train.run.training.build_training`, which applies ``train.parallel`` (DDP / FSDP2,
:func:`fira_train.run.parallel.parallelize`) between the model and the optimizer. Under
``torchrun`` every rank reads the same global batches and trains on its rows of each
micro-batch, the logged loss and the validation loss are reduced over the ranks, only rank 0
writes the run's files, and checkpoints go through :mod:`fira_train.run.dist_checkpoint`; the
distributed-only pieces are in :mod:`fira_train.run.train_parallel`. A run at any world size
trains on the same global batches as one process, to floating-point round-off.

Analyses hook into the loop through ``callbacks``
(:class:`~fira_train.run.callbacks.TrainCallback`): code that must see the gradients or the
optimizer's state at every step (recording scaling factors, injecting gradient noise) without a
second training loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from fira_optim import optimizer_state_numel
from fira_optim.state import optimizer_state_bytes
from fira_train.config.overrides import config_to_dict
from fira_train.config.resolve import resolved
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus, refuse_out_as_corpus
from fira_train.files import dumps as json_dumps, read_json, refuse_links, write_text_atomic
from fira_train.methods.model import count_parameters
from fira_train.methods.registry import get_method
from fira_train.provenance import code_version
from fira_train.run import checkpoint as ckpt
from fira_train.run import resume_check, run_files, train_parallel
from fira_train.run.callbacks import TrainCallback, stateful
from fira_train.run.divergence import DivergedError, check_loss, diverged
from fira_train.run.launch import before_the_run, is_rank_zero
from fira_train.run.metrics import MetricsLog, perplexity
from fira_train.run.parallel import DistributedEnv, all_reduce_mean, clip_grad_norm_, shard_batch
from fira_train.run.peak_memory import PeakMemory
from fira_train.run.rng import seed_everything
from fira_train.run.run_dir import check_same_data, finished_with, prepare_out_dir
from fira_train.run.run_lock import locked_run_directory
from fira_train.run.state import capture_state, restore_state
from fira_train.run.training import Training, autocast_for, build_training, resolve_device, warned_on_rank_zero

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stops before updating the weights."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite training loss {loss} at step {step}; the run stopped before "
                         "applying that step's update (lower optim.lr or enable train.grad_clip and train the run "
                         "again: a resume keeps the run's settings and would train the same steps again)")
        self.step = step
        self.loss = loss

    def __reduce__(self) -> tuple:  # crosses process boundaries (analysis workers)
        return (type(self), (self.step, self.loss))


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


def train(config: RunConfig, *, resume: str | int | None = None, overwrite: bool = False,
          corpus: Any = None, callbacks: Sequence[TrainCallback] = ()) -> dict[str, Any]:
    """Run (or resume) ``config``; returns the summary also written to ``OUT/summary.json``.

    ``resume``: None (fresh run; an existing run in OUT is an error unless ``overwrite``),
    ``"latest"`` (continue from the newest complete checkpoint, or start fresh if there is
    none) or a step number (that checkpoint; FileNotFoundError if absent). ``corpus`` lets
    several runs share one tokenised corpus (``compare``). ``callbacks`` are called in order
    at every step (:class:`TrainCallback`); their state is kept in one-process checkpoints and
    loaded on resume (stateful callbacks are refused with ``train.parallel`` ddp / fsdp2).

    With ``train.parallel`` ddp / fsdp2, every process of a ``torchrun`` launch calls this
    (:mod:`fira_train.run.train_parallel`); every rank returns the summary, rank 0 writes it.
    """
    get_method(config.optim.method)
    code_version()  # read now, as the code that runs was loaded: the summary records it
    config = resolved(config)
    # before the lock file is created: nothing is added to a folder the run may not use
    refuse_out_as_corpus(config.data, config.train.out_dir)
    run_files.check_foreign_files(config.train.out_dir, resume, overwrite, warn=False)
    # a run folder from elsewhere: no link among what the run writes sends a write outside it
    refuse_links(config.train.out_dir, run_files.WRITTEN)
    keeping = stateful(callbacks)
    if keeping and config.train.parallel != "none":
        raise ValueError(f"callbacks that keep state ({', '.join(keeping)}) run in one process only: "
                         f"distributed checkpoints do not hold their state, and train.parallel="
                         f"{config.train.parallel!r}; leave it at none")
    train_parallel.check_launch(config)
    if config.train.parallel == "none":
        with locked_run_directory(config.train.out_dir):  # one run at a time per OUT
            return _train(config, None, resume, overwrite, corpus, callbacks)
    with train_parallel.distributed_session(config) as env:
        train_parallel.check_same_config(config, env)
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
    updated if it is not finite, :class:`~fira_train.run.divergence.DivergedError` if it is above
    the divergence bound), callbacks, gradient clipping, the optimizer, the schedule,
    the method's ``after_step`` (ReLoRA's merges). Under ``train.precision=fp16`` with a plain
    step, a step whose gradients overflowed is skipped (``training.skipped_steps`` counts it): no
    ``after_step`` callbacks, no schedule step, no method ``after_step``. With step-in-backward
    the handle skips only the updates whose gradients overflowed, and the step goes on
    (``training.skipped_updates()``). The second number times the part that
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
        last = micro == accum - 1
        # Updates in the backward pass (optim.step_in_backward) wait for the last micro-batch.
        waiting = training.in_backward.accumulate() if training.in_backward and not last else None
        with train_parallel.accumulation_context(net, last=last), waiting or contextlib.nullcontext():
            with autocast:
                loss = net(input_ids=ids, labels=ids).loss  # mean over micro_batch * (seq_len - 1)
            training.scale(loss / accum).backward()  # scaled under train.precision=fp16
        loss_sum += loss.detach()
    # equal rows per rank: the mean of the ranks' means is the global mean
    step_loss = all_reduce_mean(loss_sum / accum, env) if distributed else (loss_sum / accum).item()
    if not math.isfinite(step_loss):
        raise NonFiniteLossError(step, step_loss)
    check_loss(step, step_loss)  # a loss above the divergence bound (fira_train.run.divergence)
    started = time.perf_counter()
    scaler = training.grad_scaler
    if scaler is not None:  # callbacks and clipping see the true gradients
        scaler.unscale_(optimizer)
    for callback in callbacks:
        callback.before_step(step, model, optimizer, step_loss)
    if config.train.grad_clip > 0:
        if trainable is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
        clip_grad_norm_(trainable, config.train.grad_clip)  # the global norm over FSDP2's shards too
    skipped = False
    if scaler is None:
        optimizer.step()
    else:  # skipped, and the scale lowered, if a gradient overflowed
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < before
    if skipped:  # no update: callbacks, the schedule and the method's restarts wait for the next
        training.skipped_steps += 1  # (the schedule as in the Hugging Face Trainer)
    else:
        for callback in callbacks:
            callback.after_step(step, model, optimizer, step_loss)
        training.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if training.setup.after_step is not None and not skipped:
        # the updates applied (the schedule's count): ReLoRA merges where its re-warm-up starts
        training.setup.after_step(training.scheduler.last_epoch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step_loss, time.perf_counter() - started


def _train(config: RunConfig, env: DistributedEnv | None, resume: str | int | None, overwrite: bool,
           corpus: Any, callbacks: Sequence[TrainCallback]) -> dict[str, Any]:
    """:func:`train`'s body; ``env`` is None for one process, the process group's otherwise."""
    distributed = env is not None
    out = Path(config.train.out_dir)
    main = env.is_main if distributed else is_rank_zero()
    if main and resume is not None:
        for path in ckpt.recover_swapped(out):  # before any rank looks for checkpoints
            log.warning("put back %s, which a run killed while saving that step again had set aside", path)
    if corpus is None:
        # what OUT refuses (a run there without --resume or --overwrite, another config) is said
        # before the build, which can take minutes; nothing is deleted yet
        prepare_out_dir(config, out, resume, overwrite, delete=False)
        # before OUT is prepared: a source that is missing or too small is refused before an
        # --overwrite deletes the run there or config.json is written. On every rank: a finished
        # run is kept only on the data it was trained on, which rank 0 checks while the others
        # wait (building it there alone could outlast the timeout)
        with before_the_run(resume is None):  # a failure's hint does not offer --resume for OUT's earlier run
            corpus = build_corpus(config.data, exclude=(out,))  # a run folder inside the corpus is not read
    if distributed:
        train_parallel.check_same_data(corpus, config.data.source, env)  # before OUT is prepared
    finished = _finished_summary(config, out, resume, env, main, corpus)
    if finished is not None:
        log.info("%s holds this run, finished: nothing to resume (its summary.json is kept; "
                 "--resume-step N trains again from step N)", out)
        return finished
    prepare_out_dir(config, out, resume, overwrite, delete=main or not distributed)
    if distributed:
        dist.barrier()  # every rank has checked OUT before rank 0 rewrites config.json

    state, resume_path, levers_changed, resumed_at = None, None, False, 0
    if resume is not None:
        # the newest intact checkpoint (or the one asked for), verified, of this config: chosen
        # before config.json is rewritten, so that a refused resume leaves the run as it was
        path, state, levers = resume_check.choose_checkpoint(out, resume, config, env)
        # a memory lever changed (activation checkpointing, updates in the backward pass): the
        # peak of the sittings before is another setting's
        levers_changed = bool(levers)
        resumed_at = 0 if path is None else ckpt.checkpoint_step(path)
        if path is None:
            log.info("no complete checkpoint in %s: starting from step 0", out)
        elif state is None:
            resume_path = path  # loaded into the built model (DCP loads in place)
        if main:
            ckpt.remove_partial(out)

    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    seed_everything(config.train.seed)
    device = env.device if distributed else resolve_device(config)
    autocast = autocast_for(config, device)
    training = build_training(config, corpus.vocab_size, device, env)
    model, optimizer = training.model, training.optimizer
    net = training.forward_model  # the DDP wrapper, else the model
    micro_batch = config.train.micro_batch  # divides by the processes (train_parallel.check_launch)
    # the epochs cut in whole steps: the micro-batch size (a memory lever) does not change the data
    try:
        stream = corpus.train_batches(micro_batch, config.train.seed, cut=config.train.batch_size)
    except ValueError as err:  # a step of more sequences than the corpus holds: name the setting
        raise ValueError(f"train.batch_size={config.train.batch_size}: {err}") from None
    val_batches = corpus.val_batches(micro_batch)
    step, progress = 0, {"tokens": 0, "train_time_s": 0.0, "wall_time_s": 0.0, "peak_memory_bytes": 0, "sittings": 0}
    restored = state is not None
    # under DDP every rank loads the whole state, the same: what its load warns of (NaN or Inf in
    # the optimizer's state) rank 0 says for the launch; FSDP2's ranks load shards of their own
    with warned_on_rank_zero(env if config.train.parallel == "ddp" else None):
        if restored:
            step, progress = restore_state(state, training, stream, config.data.source, callbacks)
            log.info("resumed %s from step %d", out, step)
        elif resume_path is not None:
            step, progress = train_parallel.load(out, resume_path, training, stream, config.train.parallel,
                                                 config.data.source, callbacks)
            log.info("resumed %s from step %d (%s)", out, step, resume_path.name)
    del state
    if main:  # once the settings are accepted: a start they stop leaves no config for --resume to hold to
        # (and once the checkpoint is restored: a resume it refuses, as for other data, leaves the run as it was)
        out.mkdir(parents=True, exist_ok=True)
        if resumed_at < config.train.steps:
            # a finished run trained again from an earlier step (perhaps with another memory lever):
            # its summary no longer holds once config.json is rewritten, and a kill before the new
            # one left it reused as a finished run of this config (finished_with); its final
            # checkpoint, kept, gives it again (evaluated, not trained) if nothing is trained
            (out / "summary.json").unlink(missing_ok=True)
        write_text_atomic(out / "config.json", json.dumps(config_to_dict(config), indent=2) + "\n")
    # The run's totals over its sittings (a checkpoint from before these were kept lacks them:
    # its earlier sittings' wall time and peak are then not counted, and their number unknown).
    earlier = {"wall_time_s": progress.get("wall_time_s", 0.0), "sittings": progress.get("sittings"),
               "peak_memory_bytes": progress.get("peak_memory_bytes", 0),
               "peak_memory_kind": progress.get("peak_memory_kind")}
    if levers_changed:
        earlier.update(peak_memory_bytes=0, peak_memory_kind=None)
    metrics = MetricsLog(out, tensorboard=config.train.tensorboard and main,
                         resume_step=step if resume is not None else None) if main else None

    t = config.train
    tokens_per_step = t.batch_size * config.data.seq_len
    trainable = [p for p in model.parameters() if p.requires_grad]
    memory = PeakMemory(device)
    memory.reset()
    val_loss = float("nan")
    run_start = time.perf_counter()

    for callback in callbacks:
        callback.begin(step)
    bar = tqdm(total=t.steps, initial=step, desc=config.optim.method, unit="step",
               disable=not (t.progress and main), dynamic_ncols=True)
    net.train()
    while step < t.steps:
        started = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        skipped_before, updates_before = training.skipped_steps, training.skipped_updates()
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
        scale = training.loss_scale_value()
        if scale is not None:  # train.precision=fp16: the scale after this step, and what overflowed
            record["loss_scale"] = scale
            if training.skipped_steps > skipped_before:  # GradScaler: the whole step
                record["skipped"] = True
                progress["skipped_steps"] = progress.get("skipped_steps", 0) + 1
            skipped_updates = training.skipped_updates() - updates_before  # the handle: its matrices
            if skipped_updates:
                record["skipped_updates"] = skipped_updates
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
            progress.update(_sitting_totals(earlier, run_start, memory))
            about = {resume_check.CONFIG_KEY: config_to_dict(config),  # what a resume checks
                     resume_check.ENVIRONMENT_KEY: resume_check.environment_record(
                         config, env.world_size if distributed else 1)}
            if distributed:  # every rank writes its shards
                train_parallel.save(out, step, training, stream, progress, t.keep_last, record=about)
            elif main:
                ckpt.save_checkpoint(out, step, capture_state(step, training, stream, progress, callbacks) | about)
                ckpt.prune_checkpoints(out, t.keep_last)
    bar.close()

    if math.isnan(val_loss):  # resumed at the final step: evaluate the restored weights
        val_loss, _ = evaluate(net, val_batches, device, autocast, env)
        check_loss(step, val_loss, "validation loss")
    # The held-out test set: once, on the final weights; reported, never used for a choice.
    test_batches = corpus.test_batches(micro_batch)
    test_loss = evaluate(net, test_batches, device, autocast, env)[0] if test_batches else None
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
        "test_loss": test_loss,
        "test_ppl": None if test_loss is None else perplexity(test_loss),
        "test_tokens": sum(b[:, 1:].numel() for b in test_batches),
        "tokens_per_s": progress["tokens"] / max(progress["train_time_s"], 1e-9),
        "train_time_s": progress["train_time_s"],
        # wall_time_s, peak_memory_bytes, peak_memory_kind, sittings
        **_sitting_totals(earlier, run_start, memory),
        # the handle's count is in its loss scale's state (checkpointed), GradScaler keeps none
        **({"skipped_steps": progress.get("skipped_steps", 0), "skipped_updates": training.skipped_updates()}
           if config.train.precision == "fp16" else {}),
        "optimizer_state_numel": optimizer_state_numel(optimizer),  # step counters excluded
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),  # step counters included
        "device": str(device),
        "data": corpus.describe(),
        "code": code_version(),
    }
    if distributed:  # peak memory is rank 0's
        summary.update(parallel=t.parallel, world_size=env.world_size)
    if metrics is not None:
        metrics.close()
    if main:
        write_text_atomic(out / "summary.json", json_dumps(summary, indent=2) + "\n")
    return summary


def _sitting_totals(earlier: dict[str, Any], run_start: float, memory: PeakMemory) -> dict[str, Any]:
    """The run's wall time and peak memory over every sitting so far, this one included, and how
    many sittings that is (None: unknown): what a checkpoint keeps and the summary reports. Peaks
    of another kind (CUDA allocations, process RSS) are not compared: this sitting's stands."""
    peak = memory.peak_bytes()
    if earlier["peak_memory_kind"] in (None, memory.kind):
        peak = max(peak, earlier["peak_memory_bytes"])
    return {"wall_time_s": earlier["wall_time_s"] + time.perf_counter() - run_start,
            "peak_memory_bytes": peak, "peak_memory_kind": memory.kind,
            "sittings": None if earlier["sittings"] is None else earlier["sittings"] + 1}


def _finished_summary(config: RunConfig, out: Path, resume: str | int | None, env: DistributedEnv | None,
                      main: bool, corpus: Any) -> dict[str, Any] | None:
    """The summary of the finished run of ``config`` in ``out`` (its summary and its final
    checkpoint there) when ``--resume`` has nothing to train; None otherwise. It stands, as a
    sitting that trains nothing would replace the run's throughput, wall time and peak memory
    with those of loading and evaluating it; a ValueError if it was trained on other data than
    ``corpus`` holds. Decided by rank 0 (the run directory is locked by then); under torchrun the
    others take its answer."""
    if resume != "latest":
        return None

    def decide() -> dict[str, Any] | None:
        done = finished_with(config, out) and any(
            step >= config.train.steps for step, _ in ckpt.complete_checkpoints(out))  # its last one kept
        if not done:
            return None
        summary = read_json(out / "summary.json", hint="delete summary.json and run with --resume again: the "
                                                       "final checkpoint is evaluated again, nothing retrained")
        check_same_data(out, summary, corpus.describe())
        return summary

    return resume_check.decided_on_rank_zero(env, decide) if env is not None else (decide() if main else None)
