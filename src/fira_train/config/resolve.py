"""What a config means once its method is known, and how saved configs are read back.

A :class:`~fira_train.config.run_config.RunConfig` may leave method-dependent settings open
(``None``): ``optim.lr``, ``optim.align_signs``, and ReLoRA's ``optim.relora_every`` and
``optim.relora_rewarmup``. :func:`resolved` fills them in at the start of a run, and the run's
``config.json`` records the filled-in values, so a finished run says exactly what it trained
with (a default that changes later does not change what it means):

- the learning rate: ``optim.lr`` if set, else the recipe's tuned rate for the method
  (:data:`fira_train.config.recipes.TUNED_LR`), else the method's default
  (``fira-train methods``);
- ``align_signs`` of the Fira / GaLore variants: ``optim.align_signs`` if set, else the
  variant's own setting, else :class:`fira_optim.FiraAdamW`'s default (raw SVD signs);
- ReLoRA's cycle (a quarter of the run) and re-warm-up
  (:func:`fira_train.methods.lora.default_rewarmup`).

:func:`saved_config` reads a recorded config as the version that wrote it ran: a config saved
before the held-out test split existed reads as ``data.test_fraction=0``; one saved before each
epoch's order was seeded from (seed, epoch) as ``data.epoch_order=1`` (``seed + epoch``); a
ReLoRA run recorded without its cycle and re-warm-up with the ones the versions before ran (a
quarter of the run, 2% of a cycle); configs saved while aligned signs were the library's default
(before the value was recorded) as ``align_signs=true``, and those of the versions before sign
alignment existed at all, which record no ``train.parallel`` either, as raw signs. Such a run is
then neither reused nor resumed under today's defaults, and resumes with the values it is read
as. Two short windows cannot be told apart from their neighbours: ReLoRA runs made just before
the schedule was recorded (they ran today's re-warm-up), and runs made in the one version that
aligned signs without recording ``train.parallel``; train those again (``--overwrite``).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import fira_optim
from fira_train.config.overrides import config_from_dict
from fira_train.config.recipes import TUNED_LR
from fira_train.config.run_config import RunConfig
from fira_train.methods.lora import legacy_rewarmup, relora_schedule
from fira_train.methods.registry import get_method

#: What configs saved before ``align_signs`` was recorded ran with (FiraAdamW's default then).
LEGACY_ALIGN_SIGNS = True


def _library_align_signs() -> bool:
    return inspect.signature(fira_optim.FiraAdamW).parameters["align_signs"].default


def tuned_lr(recipe: str, method: str) -> float | None:
    """The learning rate the recipe's committed sweep chose for ``method``, if it has one."""
    return TUNED_LR.get(recipe, {}).get(method)


def resolved_lr(config: RunConfig) -> float:
    """``optim.lr``; else the recipe's tuned rate for the method; else the method's default."""
    if config.optim.lr is not None:
        return config.optim.lr
    tuned = tuned_lr(config.recipe, config.optim.method)
    return tuned if tuned is not None else get_method(config.optim.method).default_lr


def resolved_align_signs(config: RunConfig) -> bool | None:
    """``optim.align_signs`` as the Fira / GaLore variant will run it (None for other methods)."""
    variant = fira_optim.VARIANTS.get(config.optim.method)
    if variant is None or config.optim.align_signs is not None:
        return config.optim.align_signs
    return variant.get("align_signs", _library_align_signs())


def resolved(config: RunConfig) -> RunConfig:
    """``config`` with its learning rate and sign alignment filled in, and ReLoRA's cycle and
    re-warm-up (what a run records: a default that changes later does not change its meaning)."""
    optim = replace(config.optim, lr=resolved_lr(config), align_signs=resolved_align_signs(config))
    if config.optim.method == "relora":
        every, rewarmup = relora_schedule(config)
        optim = replace(optim, relora_every=every, relora_rewarmup=rewarmup)
    return replace(config, optim=optim)


def saved_config(values: Any) -> RunConfig:
    """A recorded config (``config.json``, a checkpoint's or ``diverged.json``'s record) as the
    version that wrote it ran; see the module docstring."""
    data = values.get("data") if isinstance(values, dict) else None
    if isinstance(data, dict) and "test_fraction" not in data:
        # saved before the test split existed: those runs trained on every non-validation document
        data = {**data, "test_fraction": 0.0}
        values = {**values, "data": data}
    if isinstance(data, dict) and "epoch_order" not in data:
        # saved before the rule was recorded: those runs seeded epoch e with seed + e
        values = {**values, "data": {**data, "epoch_order": 1}}
    optim = values.get("optim") if isinstance(values, dict) else None
    train = values.get("train") if isinstance(values, dict) else None
    if isinstance(optim, dict) and optim.get("method") == "relora" and (
            optim.get("relora_every") is None or optim.get("relora_rewarmup") is None):
        # recorded unresolved (before f1409db): a quarter of the run, and 2% of a cycle, the
        # default until 14fe035 (the runs of the 34 minutes between ran 10 steps: not told apart)
        steps = train.get("steps") if isinstance(train, dict) else None
        every = optim.get("relora_every") or (max(1, steps // 4) if isinstance(steps, int) else None)
        if every is not None:
            rewarmup = optim.get("relora_rewarmup") or legacy_rewarmup(every)
            optim = {**optim, "relora_every": every, "relora_rewarmup": rewarmup}
            values = {**values, "optim": optim}
    if isinstance(optim, dict) and optim.get("align_signs") is None:
        variant = fira_optim.VARIANTS.get(optim.get("method", "fira"))
        if variant is not None:
            # train.parallel came one commit after sign alignment: a config without it predates
            # alignment (raw signs), but for runs made at that one commit
            legacy = LEGACY_ALIGN_SIGNS if not isinstance(train, dict) or "parallel" in train else False
            values = {**values, "optim": {**optim, "align_signs": variant.get("align_signs", legacy)}}
    return config_from_dict(values)
