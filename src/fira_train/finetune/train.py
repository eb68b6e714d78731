"""Fine-tuning one model with one method through the Hugging Face ``Trainer`` (Fira and GaLore through
:class:`fira_optim.integrations.FiraTrainer`, the paper's other baselines with the optimizer of
:func:`peer_optimizer`), measuring time, loss, optimizer state and peak memory."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from fira_optim import optimizer_state_numel
from fira_optim.state import optimizer_state_bytes
from fira_optim.integrations import FiraTrainer, target_parameter_names
from fira_train.config.overrides import describe_changed
from fira_train.finetune.checkpoints import checkpoint_dir, checkpoint_folders, checkpoint_step, incomplete
from fira_train.finetune.config import FIRA_METHODS, LORA_METHODS, PEER_METHODS, FinetuneConfig, FinetuneError
from fira_train.finetune.data import PaddingCollator, tokenize_for_training, train_limit
from fira_train.files import parse_json, read_json, read_regular_text, write_text_atomic
from fira_train.run import run_files
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
        with warnings.catch_warnings():
            # peft (0.21.2 and before) reads the model's is_gradient_checkpointing, which transformers
            # deprecated for is_activation_checkpointing: a warning of their code the user can do nothing about
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            return peft.get_peft_model(model, lora)
    except ValueError as err:
        raise FinetuneError(f"lora_targets={config.lora_targets!r} do not fit the model: {err}") from None


#: How the warnings of :func:`fira_optim.integrations.target_parameter_names` begin: the
#: Trainer's argument, which finetune fills from ``--target-modules``.
TRAINER_TARGETS = "optim_target_modules="


def checked_targets(model: torch.nn.Module, config: FinetuneConfig) -> list[str]:
    """The names of the weights that ``config.target_modules`` selects
    (:func:`~fira_optim.integrations.target_parameter_names`), with its error and its warnings
    (an entry that selects nothing) naming the option the user gave, ``--target-modules``, where
    they named the Trainer's ``optim_target_modules``."""
    targets = config.optim_target_modules()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            names = target_parameter_names(model, targets)
        except ValueError as err:
            raise FinetuneError(f"target_modules={config.target_modules!r}: {err}") from None
    given = f"{TRAINER_TARGETS}{list(targets) if isinstance(targets, (list, tuple)) else targets!r}"
    for warned in caught:
        text = str(warned.message)
        if text.startswith(given):
            text = f"--target-modules {config.target_modules!r}" + text[len(given):]
        warnings.warn(text, warned.category, stacklevel=2)
    return names


#: The Trainer's AdamW defaults (``adam_beta1``, ``adam_beta2``, ``adam_epsilon``), used by the peers too.
BETAS, EPS = (0.9, 0.999), 1e-8


def peer_optimizer(model: torch.nn.Module, config: FinetuneConfig) -> torch.optim.Optimizer:
    """The optimizer of ``apollo``, ``flora`` or ``slimadam`` over ``model``'s trainable weights.

    - ``apollo`` (apollo-torch): channel-wise APOLLO at ``--rank`` on the ``--target-modules``
      linear weights, AdamW on the rest, scale ``d / r`` (the model's width over the rank): the
      package README's fine-tuning setting ("a scaling factor derived from the ratio of LLaMA-8B
      dimension (4096) to rank (128)", i.e. 32), which makes the scaled update Adam-sized;
    - ``flora`` (flora-opt): every trainable weight, momentum compressed at ``--rank`` and
      resampled every ``--update-proj-gap`` steps (:mod:`fira_train.methods.flora`);
    - ``slimadam``: the SlimAdam paper's rules (:mod:`fira_train.methods.slimadam`).
    """
    from fira_train.methods.apollo import apollo_groups, apollo_optimizer
    from fira_train.methods.flora import build_flora_optimizer
    from fira_train.methods.slimadam import SlimAdamW, slimadam_param_groups

    method, lr, wd = config.effective_method, config.effective_lr, config.weight_decay
    if method == "apollo":
        projected_names = set(checked_targets(model, config))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        rank = config.effective_rank
        groups = apollo_groups([p for n, p in trainable if n in projected_names],
                               [p for n, p in trainable if n not in projected_names],
                               rank=rank, scale_type="channel", scale=model.config.hidden_size / rank,
                               update_proj_gap=config.update_proj_gap)
        return apollo_optimizer(groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, scale_front=False,
                                seed=config.seed)
    if method == "flora":
        return build_flora_optimizer(model, lr=lr, rank=config.effective_rank, kappa=config.update_proj_gap,
                                     beta1=BETAS[0], weight_decay=wd, seed=config.seed)
    if method == "slimadam":
        return SlimAdamW(slimadam_param_groups(model), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    raise ValueError(f"method={method!r} is not one of {PEER_METHODS}")


#: The settings a checkpoint must have been saved with to be continued (what the training computes).
RESUME_KEYS = ("model", "data_dir", "tasks", "method", "recipe", "steps", "max_train", "batch_size", "lr",
               "warmup_steps", "weight_decay", "rank", "update_proj_gap", "alpha", "target_modules", "lora_r",
               "lora_alpha", "lora_dropout", "lora_targets", "cutoff_len", "train_on_inputs", "seed",
               "step_in_backward", "state_dtype", "state_rounding", "precision")
#: What the options added to :data:`RESUME_KEYS` since records were first written meant before
#: them (such a record's run trained with these).
SETTINGS_BEFORE_RECORDED = {"step_in_backward": False, "state_dtype": "float32", "state_rounding": "nearest",
                            "precision": "fp32"}


def resume_point(config: FinetuneConfig) -> str | None:
    """The newest complete checkpoint of an earlier, interrupted start of the same run, or None
    (newer incomplete ones are removed, each with a ``UserWarning``). A checkpoint saved with
    other settings, or without the record of its settings that a start writes beside it (another
    run's, copied in), is refused (continuing it would mix two runs)."""
    folder = checkpoint_dir(config)
    # an earlier start's checkpoints are continued even where this start writes none (--save-steps 0)
    if not (config.trains and folder.is_dir() and checkpoint_folders(folder)):
        return None
    _check_settings(config, folder)  # before anything is removed: another run's folder is left as it is
    return newest_complete_checkpoint(folder)


def _check_settings(config: FinetuneConfig, folder: Path) -> None:
    """FinetuneError if the checkpoints in ``folder`` were saved with other settings than ``config``'s,
    or without a record of their settings (``run_settings.json``)."""
    record = folder / "run_settings.json"
    hint = "remove the folder to start again, or choose another --out"
    if not record.is_file():
        # a run writes it before its first checkpoint (and removes it after them): checkpoints
        # without it are no start of this run's (copied in, another tool's), which were continued
        # as this run's on the few settings a record lacks, then deleted with the results written
        found = ", ".join(path.name for _, path in checkpoint_folders(folder))
        raise FinetuneError(f"{folder} holds checkpoints ({found}) without {record.name}, the record of the "
                            f"settings a start of this run writes beside them: they are not known to be this "
                            f"run's; {hint}")
    saved = read_json(record, hint=hint)
    if not isinstance(saved, dict):  # compared with nothing, it continued whatever it held
        raise FinetuneError(f"{record} is not a record of a run's settings (a JSON object): {hint}")
    given, effective = _settings(config, effective=False), _settings(config)
    unused = {k for k, v in config.used_options().items() if v is None}
    # a key the record lacks (written before it was kept) is not compared, nor an option the
    # method does not use; a value left out and one given equal to what it resolves to are the
    # same run (records kept either)
    saved = {**SETTINGS_BEFORE_RECORDED, **saved}  # a record from before these options: their values then
    differ = sorted(k for k in effective
                    if k in saved and k not in unused and saved[k] not in (given[k], effective[k]))
    if differ:
        found = describe_changed(saved, effective, differ)
        raise FinetuneError(f"{folder} holds checkpoints of a run with other settings ({found}): "
                            f"remove it to start again, or choose another --out")


def newest_complete_checkpoint(folder: Path) -> str | None:
    """The newest ``checkpoint-<step>`` in ``folder`` that the Trainer finished writing, or None.
    The Trainer writes a checkpoint in place, ``trainer_state.json`` last: a start killed while
    writing one leaves a folder without it (or with part of it), which resuming from failed on
    ("No such file or directory") at every start. Such folders are removed, each named in a
    ``UserWarning``; the older checkpoint is still there (the Trainer drops it only after the new one)."""
    for step, path in reversed(checkpoint_folders(folder)):
        problem = incomplete(path, step)
        if problem is None:
            return str(path)
        # a warning (stderr, one line from the command line), not the run's progress on stdout
        warnings.warn(f"{path} is incomplete ({problem}: a start stopped while writing it); removing it and "
                      "continuing from the checkpoint before it", UserWarning, stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
    return None


def _settings(config: FinetuneConfig, effective: bool = True) -> dict[str, Any]:
    """The :data:`RESUME_KEYS` of ``config`` as JSON values: as in effect (defaults resolved:
    the learning rate, warm-up, training records and rank a run trains with; None for an option
    the method does not use; the data folder and a local model as absolute paths), or as given."""
    values = {k: v for k, v in asdict(config).items() if k in RESUME_KEYS}
    if effective:
        values.update(config.used_options(), lr=config.effective_lr, warmup_steps=config.effective_warmup,
                      max_train=train_limit(config), data_dir=_local_path(config.data_dir),
                      model=_local_path(config.model))
    return json.loads(json.dumps(values, default=str))


def _local_path(name: str | None) -> str | None:
    """``name`` as an absolute path where it names a file or folder here (a hub id, or None for the
    packaged model, as it is): ``data/``, ``data`` and ``/work/data`` are one folder, and the
    same ``data`` typed in another working directory is another (compared as typed, the first
    two were refused as another run's settings and the last was continued, mixing two runs)."""
    if name is None or not Path(name).exists():
        return name
    return str(Path(name).resolve())


#: Beside the checkpoints: each start (sitting) of the run, up to its newest checkpoint.
SITTINGS_FILE = "sittings.json"


def earlier_sittings(config: FinetuneConfig, resume: str | None) -> list[dict[str, Any]] | None:
    """The sittings that brought the run to checkpoint ``resume``, each ``{from_step, to_step,
    seconds, peak_rss_mib, threads}`` as :class:`SittingRecorder` wrote them: [] for a new run,
    None where they are unknown (checkpoints written without the record, or a record that does
    not reach ``resume``: a start killed between a checkpoint and its record)."""
    if resume is None:
        return []
    try:
        recorded = parse_json(read_regular_text(checkpoint_dir(config) / SITTINGS_FILE))
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, list) or not all(isinstance(s, dict) for s in recorded):
        return None
    steps = [0, *(s.get("to_step") for s in recorded)]
    chained = all(s.get("from_step") == steps[i] for i, s in enumerate(recorded))
    return recorded if chained and steps[-1] == checkpoint_step(resume) else None


class SittingRecorder(transformers.TrainerCallback):
    """Writes ``trainer/sittings.json`` at every checkpoint: the sittings before this one and
    this one up to that checkpoint. A run stopped and continued (with ``--threads`` changed,
    perhaps) so reports its whole training time and peak memory, not only its last sitting's;
    time spent after a sitting's last checkpoint is not counted (the next sitting redoes it)."""

    def __init__(self, path: Path, earlier: list[dict[str, Any]] | None, from_step: int, rss_measured: bool):
        self.path, self.earlier, self.from_step, self.rss_measured = path, earlier, from_step, rss_measured
        self.started = time.perf_counter()

    def entry(self, step: int) -> dict[str, Any]:
        """This sitting from its start to ``step``."""
        peak = rss_peak_bytes() if self.rss_measured else None
        return {"from_step": self.from_step, "to_step": step, "seconds": time.perf_counter() - self.started,
                "peak_rss_mib": peak / 2**20 if peak else None, "threads": torch.get_num_threads()}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.earlier is not None:  # an unknown past is not recorded as a partial one
            write_text_atomic(self.path, json.dumps([*self.earlier, self.entry(state.global_step)], indent=2))


class ProgressBar(transformers.TrainerCallback):
    """The optimizer steps as a tqdm bar with the time left, the last step's loss and learning rate
    beside it, as ``fira-train pretrain`` shows them, in place of the Trainer's one printed dict of
    its log per step (its ``disable_tqdm`` printer)."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.desc, unit="step",
                        disable=not state.is_world_process_zero, dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        if "loss" in logs:  # a step's log, not the training's summary at its end
            self.bar.set_postfix({k: f"{logs[key]:.4g}" for k, key in (("loss", "loss"), ("lr", "learning_rate"))
                                  if isinstance(logs.get(key), (int, float))})

    def close(self) -> None:
        if self.bar is not None:  # also after an error: its line ends before the error's
            self.bar.close()


class StopOnNonFiniteLoss(transformers.TrainerCallback):
    """Stops the training at the first step whose loss is not finite (a learning rate that blew the
    weights up), with :class:`FloatingPointError`, before that step's checkpoint is written (the
    Trainer logs, then saves). Its ``logging_nan_inf_filter``, which the run turns off, logged such
    a loss as the mean of the steps logged before it (0.0 when it logs every step), and the run
    went on to evaluate NaN weights and write their accuracy as its results."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(non_finite_loss(state.global_step, loss))


def non_finite_loss(step: int, loss: float) -> str:
    """The message of a run whose training loss at ``step`` is not finite."""
    return (f"the run diverged at step {step}: training loss {loss} (not finite); lower --lr and train the run "
            "again")


def counting_tokens(trainer_class: type) -> type:
    """``trainer_class`` that adds each micro-batch's non-padding tokens (its attention mask's
    sum) to ``state.num_input_tokens_seen``, which checkpoints carry over sittings. The Trainer's
    own ``include_num_input_tokens_seen="non_padding"`` is recent (August 2025): older transformers,
    which the ``train`` extra allows, take the string as True and count the padding too."""
    class CountingTokens(trainer_class):
        def training_step(self, model, inputs, *args, **kwargs):
            self.state.num_input_tokens_seen += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    CountingTokens.__name__ = CountingTokens.__qualname__ = trainer_class.__name__
    return CountingTokens


def remove_checkpoints(config: FinetuneConfig) -> None:
    """Delete this run's checkpoints once its results are written (they hold the whole model
    and optimizer state): the Trainer's ``checkpoint-<step>`` folders and the run's records beside
    them, then ``OUT/trainer`` itself if nothing else is left in it. Not the folder whole: with
    ``--out .`` in a project that has a trainer/ of its own (a package of that name), that was
    deleted with them."""
    records = {name + suffix for name in ("run_settings.json", SITTINGS_FILE) for suffix in ("", ".tmp")}
    checkpoints = {path for _, path in checkpoint_folders(checkpoint_dir(config))}
    with contextlib.suppress(OSError):  # the results are written: what stays is named by the next start
        run_files.remove_run_entries(checkpoint_dir(config),  # .tmp: a write interrupted
                                     lambda path: path in checkpoints or (path.name in records and path.is_file()))


def check_answer_tokens(features: list[dict], cutoff_len: int) -> str | None:
    """FinetuneError if no tokenized record keeps a label to train on (the prompt alone fills
    ``cutoff_len`` and ``train_on_inputs`` is off: the run trained on nothing and reported a loss
    of 0); a warning's text if some records keep none: each trains nothing, and a batch made of
    them only has a loss of 0 and a zero gradient, on which the optimizer still steps (its
    momentum and weight decay move the weights)."""
    answerless = sum(1 for f in features if all(label == -100 for label in f["labels"]))
    if answerless == len(features):
        raise FinetuneError(f"cutoff_len={cutoff_len} leaves no answer token to train on in any of the "
                            f"{len(features)} records (the prompt alone fills it, and train_on_inputs is off): "
                            "raise --cutoff-len")
    if not answerless:
        return None
    return (f"cutoff_len={cutoff_len} leaves no answer token in {answerless} of the {len(features)} training records "
            "(the prompt alone fills it, and train_on_inputs is off): they train nothing, and a batch of only such "
            "records steps on the optimizer's momentum alone; raise --cutoff-len to train on them")


def train_model(model: torch.nn.Module, tokenizer: Any, train: list[dict], config: FinetuneConfig,
                resume: str | None = None) -> dict[str, Any]:
    """Train ``model`` (prepared by :func:`prepare_model`) on the ``train`` records with
    ``config``'s method; returns time, steps, losses, optimizer-state size and peak memory.

    With ``config.save_steps`` the Trainer checkpoints every that many steps (model, optimizer,
    schedule, RNG state and data position). ``resume``: the checkpoint to continue from
    (:func:`resume_point`); ``sittings`` then lists every start with its time and peak
    (:class:`SittingRecorder`), ``seconds`` is the sum of their times (as the report gives it;
    this start's alone where the earlier starts were not recorded), the peak memory is this
    start's, and ``resumed_from_step`` says where it began."""
    method = config.effective_method
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    features = [tokenize_for_training(tokenizer, r, config.cutoff_len, config.train_on_inputs) for r in train]
    warning = check_answer_tokens(features, config.cutoff_len)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    args = transformers.TrainingArguments(
        output_dir=str(checkpoint_dir(config)),
        per_device_train_batch_size=config.batch_size,
        max_steps=config.steps,
        learning_rate=config.effective_lr,
        lr_scheduler_type="linear",
        warmup_steps=config.effective_warmup,
        weight_decay=config.weight_decay,
        logging_steps=1,
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN, and stops the run (StopOnNonFiniteLoss)
        save_strategy="steps" if config.save_steps else "no",
        save_steps=config.save_steps,
        save_total_limit=1,
        report_to="none",
        seed=config.seed,
        data_seed=config.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        optim="adamw_torch",
        bf16=config.precision == "bf16",
        fp16=config.precision == "fp16",
        # updates in the backward pass cannot clip by the global norm (FiraTrainer refuses it)
        max_grad_norm=0.0 if config.step_in_backward else 1.0,
    )
    common = dict(model=model, args=args, train_dataset=features, data_collator=PaddingCollator(pad_id))
    if method in FIRA_METHODS:
        targets = ["lora_A", "lora_B"] if method == "fira-lora" else config.optim_target_modules()
        if method != "fira-lora":  # the Trainer's error and warnings name its optim_target_modules,
            checked_targets(model, config)  # not --target-modules: said here, not again as it builds the optimizer
        fira_options = {"variant": "galore" if method == "galore" else "fira", "rank": config.effective_rank,
                        "update_proj_gap": config.update_proj_gap, "alpha": config.alpha,
                        "optim_target_modules": targets, "state_dtype": config.state_dtype,
                        "state_rounding": config.state_rounding}
        trainer = counting_tokens(FiraTrainer)(fira_options=fira_options, step_in_backward=config.step_in_backward,
                                               **common)
    elif method in PEER_METHODS:  # the Trainer schedules the optimizer given (linear warm-up and decay)
        trainer = counting_tokens(transformers.Trainer)(**common, optimizers=(peer_optimizer(model, config), None))
    else:
        trainer = counting_tokens(transformers.Trainer)(**common)

    if config.save_steps:  # what the checkpoints about to be written were made with
        checkpoint_dir(config).mkdir(parents=True, exist_ok=True)
        write_text_atomic(checkpoint_dir(config) / "run_settings.json", json.dumps(_settings(config), indent=2))
    earlier = earlier_sittings(config, resume)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    reset = reset_rss_peak()
    recorder = SittingRecorder(checkpoint_dir(config) / SITTINGS_FILE, earlier,
                               checkpoint_step(resume) if resume else 0, reset)
    trainer.add_callback(recorder)
    trainer.add_callback(StopOnNonFiniteLoss())
    trainer.remove_callback(transformers.PrinterCallback)  # disable_tqdm's dicts: the bar says it
    progress = ProgressBar(method)
    trainer.add_callback(progress)
    started = recorder.started  # the sitting's clock is the run's
    try:
        with warnings.catch_warnings():  # checked_targets warned of the targets, naming --target-modules
            warnings.filterwarnings("ignore", message=TRAINER_TARGETS, category=UserWarning)
            trainer.train(resume_from_checkpoint=resume)
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if not losses:
        raise RuntimeError(f"training with method={method!r} logged no loss")
    if not all(math.isfinite(x) for x in losses):  # one StopOnNonFiniteLoss missed: still no results
        step, loss = next((i + 1, x) for i, x in enumerate(losses) if not math.isfinite(x))
        raise FloatingPointError(non_finite_loss(step, loss))
    tail = losses[-max(1, len(losses) // 10) :]
    state_numel = optimizer_state_numel(optimizer)
    sittings = None if earlier is None else [*earlier, recorder.entry(trainer.state.global_step)]
    if sittings and len(sittings) > 1:  # the whole training's time, as the report sums it
        seconds = sum(s["seconds"] for s in sittings)
    return {
        "seconds": seconds,
        "steps": trainer.state.global_step,
        "examples": len(features),
        # every sitting's (the Trainer's state resumes it), records seen twice counted twice
        "tokens": int(trainer.state.num_input_tokens_seen),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_tail_mean": sum(tail) / len(tail),
        "loss_history": losses,
        "optimizer": type(optimizer).__name__,
        # FiraAdamW's sign alignment (raw SVD signs by default; None for other optimizers)
        "align_signs": optimizer.defaults.get("align_signs"),
        "optimizer_state_numel": state_numel,
        "optimizer_state_mib": optimizer_state_bytes(optimizer) / 2**20,  # as stored (int8, bf16, fp32)
        "train_peak_rss_mib": (rss_peak_bytes() or 0) / 2**20 if reset else None,
        "train_peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "resumed_from_step": checkpoint_step(resume) if resume else None,
        # every start of the run, this one last (None: the earlier ones were not recorded)
        "sittings": sittings,
    }
