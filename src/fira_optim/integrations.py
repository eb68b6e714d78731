r"""Fira in the Hugging Face ``transformers.Trainer`` (needs ``transformers``; ``import fira_optim`` does not).

The Trainer offers GaLore by name (``optim="galore_adamw"``) and reads three arguments for it;
this module gives them the same meaning for Fira, so switching is a change of class:

* ``optim_target_modules`` -- which weights are projected. Exactly the Trainer's rule
  (``transformers.trainer_utils.check_target_module_exists``): a *string* is a regular
  expression that must match the whole module name (``re.fullmatch``), except ``"all-linear"``
  (or ``"all_linear"``), which selects every ``nn.Linear``, the untied output head included (peft's
  ``"all-linear"`` leaves it out); a *list* selects a module whose name
  equals an entry, contains an entry as a substring, or fully matches an entry as a regular
  expression. Only ``nn.Linear`` modules are projected (their ``weight``); a tied output head
  whose weight is registered first as the input embedding is not (the parameter keeps its
  first name, as in ``named_parameters()``). Parameters with ``requires_grad=False`` are left
  out, so a frozen base model under ``peft`` is never in the optimizer.
* ``optim_args`` -- ``"rank=64,update_proj_gap=100,alpha=0.25,proj_type=std"``; GaLore's
  ``scale`` is accepted as a synonym of ``alpha``, and any other keyword of
  :class:`fira_optim.FiraAdamW` may be given (``gamma=1.01``, ``projector=svd``, ...), converted
  to the type of its default.
* ``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``, ``weight_decay`` -- as for
  ``adamw_torch``. Weight decay goes to the Trainer's decay parameters (not biases or norms).
  The Trainer's ``galore_adamw`` passes galore-torch the learning rate only (transformers 5.24):
  its own ``betas=(0.9, 0.999)``, ``eps=1e-6`` and no weight decay apply, whatever these
  arguments say. To continue such a run with ``variant="galore"``, give ``adam_epsilon=1e-6`` and
  ``weight_decay=0`` (and the default betas): the projected matrices then take galore-torch's
  steps (to float round-off); the others differ where ``eps`` is not small beside ``sqrt(v)``
  (galore-torch adds it before the bias correction, ``torch.optim.AdamW`` after).

Three ways to use it::

    # 1. A Trainer subclass: create_optimizer builds Fira from the TrainingArguments.
    trainer = FiraTrainer(model=model, args=TrainingArguments(..., optim_target_modules="all-linear",
                          optim_args="rank=64,update_proj_gap=100,alpha=0.25"), train_dataset=ds)

    # 2. An (optimizer, scheduler) pair for Trainer(optimizers=...).
    opt, sched = create_fira_optimizer_and_scheduler(model, args, num_training_steps=1000)
    trainer = Trainer(model=model, args=args, optimizers=(opt, sched), train_dataset=ds)

    # 3. The Trainer's own factory hook (it then builds its usual scheduler).
    trainer = Trainer(model=model, args=args, optimizer_cls_and_kwargs=fira_optimizer_cls_and_kwargs(model, args))

Fira on LoRA adapters (the released fine-tuning recipe: LoRA ``r=32``, Fira rank 16): wrap the
model with ``peft`` first, then target the adapter matrices, e.g.
``optim_target_modules=["lora_A", "lora_B"]``. ``lora_A`` is ``r x n`` and ``lora_B`` is
``m x r``; Fira's ``std`` projection projects the *smaller* side, which for both is the LoRA rank
``r``: Adam's moments become ``16 x n`` and ``m x 16`` (half of LoRA's) while the update stays a
full ``r``-rank matrix through Fira's scaled residual. A matrix whose smaller side is ``<= rank``
is not compressed: the library updates it with plain Adam.

The optimizer's state holds tensors and plain Python values only, so the Trainer's checkpoints
(``optimizer.pt`` written with ``torch.save``, read with ``torch.load(weights_only=True)``) save
and resume it; :func:`fira_optim.optimizer_state_numel` reports its size.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import nn

try:
    import transformers
    from transformers import Trainer
except ImportError as _err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "fira_optim.integrations needs the `transformers` package (pip install 'transformers>=4.45'); "
        "the optimizer itself (`import fira_optim`) needs torch only"
    ) from _err

from . import Fira, FiraAdamW, LossScale, VARIANTS, step_in_backward
from .options import did_you_mean

__all__ = [
    "parse_optim_args",
    "target_module_matches",
    "target_parameter_names",
    "trainer_param_groups",
    "create_fira_optimizer",
    "create_fira_optimizer_and_scheduler",
    "fira_optimizer_cls_and_kwargs",
    "FiraTrainer",
]

#: ``optim_args`` keys that are another library's name for a Fira keyword.
OPTIM_ARG_ALIASES: dict[str, str] = {"scale": "alpha"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _fira_keyword_defaults() -> dict[str, Any]:
    """Keyword -> default of ``FiraAdamW.__init__`` (the options a param group may carry)."""
    signature = inspect.signature(FiraAdamW.__init__)
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if name not in ("self", "params") and p.default is not inspect.Parameter.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _convert(key: str, text: str, default: Any, source: str) -> Any:
    # The type of the default decides; None-defaulted options take true / false, an int, a float or a string.
    if key == "process_group":
        # a ProcessGroup object: the text would be kept as the group, and split_refresh would fail on it later
        raise ValueError(f"{source}: process_group={text!r} cannot be given as text; pass a ProcessGroup as the "
                         f"process_group keyword of create_fira_optimizer (or leave it unset: the default group)")
    if text.lower() in ("none", "null"):
        return None
    if isinstance(default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{source}: {key}={text!r} must be a boolean (true/false)")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{source}: {key}={text!r} must be an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{source}: {key}={text!r} must be a number") from None
    if isinstance(default, (tuple, list)):
        raise ValueError(f"{source}: {key} takes a tuple; pass it as a keyword, not as text")
    if default is None:
        # foreach / fused: None (torch's choice), True or False; only the words, as "1" is a number
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        for cast in (int, float):
            try:
                return cast(text)
            except ValueError:
                pass
    return text


def parse_optim_args(optim_args: str | dict[str, Any] | None) -> dict[str, Any]:
    """Fira keywords from a Trainer ``optim_args`` string (``"rank=64,update_proj_gap=100,alpha=0.25"``).

    Whitespace is ignored (spaces, and the line breaks of a multi-line config value), ``scale``
    means ``alpha``, values are converted to the type of the keyword's default in
    :class:`FiraAdamW`. A dict passes through the same checks. Unknown keys, malformed items and
    a keyword given twice (``rank=8,rank=16``, or ``scale`` and ``alpha``: the Trainer's parser
    keeps the last one without a word) raise ``ValueError`` naming them.
    """
    return _parse_options(optim_args, "optim_args")


def _parse_options(optim_args: str | dict[str, Any] | None, source: str) -> dict[str, Any]:
    """:func:`parse_optim_args`, its errors naming ``source`` (``optim_args`` or ``fira_options``:
    the argument the user wrote the value in)."""
    if optim_args is None or optim_args == "":
        return {}
    if isinstance(optim_args, dict):
        items = [(str(k), v, f"{k}={v!r}") for k, v in optim_args.items()]
    elif isinstance(optim_args, str):
        items = []
        for written in optim_args.split(","):
            item = "".join(written.split())
            if not item:
                continue
            if item.count("=") != 1:  # the item as written: 'rank 8', not the 'rank8' it becomes
                raise ValueError(f"{source}: item {written.strip()!r} of {optim_args!r} must be key=value")
            key, value = item.split("=")
            items.append((key, value, item))
    else:
        raise TypeError(f"{source} must be a string like 'rank=64,alpha=0.25' or a dict, got {optim_args!r}")
    defaults = _fira_keyword_defaults()
    parsed: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for key, value, item in items:
        key = OPTIM_ARG_ALIASES.get(key, key)
        if key in ("lr", "betas", "eps", "weight_decay"):
            raise ValueError(
                f"{source}: {key!r} comes from the TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, "
                f"weight_decay), not from {source}"
            )
        if key == "variant" and source == "optim_args" and isinstance(value, str):
            # a TrainingArguments-only config (a CLI, a YAML file) reaches no fira_options: name the options
            options = VARIANTS.get(value)
            if options == {}:
                raise ValueError(f"optim_args: variant={value!r} is not a FiraAdamW keyword; it is the default "
                                 f"(no option to set): leave it out")
            spelt = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (options or {}).items())
            raise ValueError(
                f"optim_args: variant={value!r} is not a FiraAdamW keyword: give the variant's options, "
                f"{spelt!r}, or fira_options={{'variant': {value!r}}} (FiraTrainer; variant= of create_fira_optimizer)"
                if options is not None else
                f"optim_args: variant={value!r} is not a FiraAdamW keyword, nor one of fira_optim.VARIANTS "
                f"{sorted(VARIANTS)}; give a variant as fira_options={{'variant': ...}} (FiraTrainer)")
        if key not in defaults:
            raise ValueError(f"{source}: unknown key {key!r}{did_you_mean(key, defaults)}; "
                             f"FiraAdamW takes {sorted(defaults)}")
        if key in written_as:
            raise ValueError(f"{source}: {key!r} is given twice (as {written_as[key]!r} and {item!r}); give it once")
        written_as[key] = item
        parsed[key] = _convert(key, value, defaults[key], source) if isinstance(value, str) else value
    return parsed


def _is_all_linear(optim_target_modules: Any) -> bool:
    return isinstance(optim_target_modules, str) and optim_target_modules.replace("_", "-") == "all-linear"


def target_module_matches(optim_target_modules: str | Sequence[str], module_name: str) -> bool:
    """Whether ``module_name`` is selected by ``optim_target_modules`` (the Trainer's rule, see module doc).

    A string is a regular expression over the whole name (``"all-linear"`` selects everything
    here; the ``nn.Linear`` filter is applied by the caller). A list entry selects a name that
    equals it, contains it, or fully matches it as a regular expression.
    """
    if _is_all_linear(optim_target_modules):
        return True
    if isinstance(optim_target_modules, str):
        return re.fullmatch(optim_target_modules, module_name) is not None
    return any(
        entry == module_name or entry in module_name or re.fullmatch(entry, module_name) is not None
        for entry in optim_target_modules
    )


def _check_target_modules(optim_target_modules: Any) -> None:
    if optim_target_modules is None:
        raise ValueError(
            "optim_target_modules is None: Fira needs to know which weights to project, e.g. "
            "optim_target_modules='all-linear', ['q_proj', 'v_proj'] or r'.*\\.mlp\\..*'"
        )
    ok = isinstance(optim_target_modules, str) or (
        isinstance(optim_target_modules, (list, tuple)) and all(isinstance(e, str) for e in optim_target_modules)
    )
    if not ok:
        raise TypeError(
            f"optim_target_modules must be a list of strings, a regex string or 'all-linear', "
            f"got {optim_target_modules!r}"
        )
    # a string is a regex; each list entry is one too (tried on the linear layers' names that neither
    # equal nor contain it): a bad one failed there as a bare re.error, naming neither it nor the argument
    single = isinstance(optim_target_modules, str)
    for entry in [optim_target_modules] if single else optim_target_modules:
        if single and _is_all_linear(entry):
            continue
        try:
            re.compile(entry)
        except re.error as err:
            which = "" if single else f": entry {entry!r}"
            raise ValueError(f"optim_target_modules={optim_target_modules!r}{which} is not a valid regex: "
                             f"{err}") from None


def _not_linear(model: nn.Module, optim_target_modules: str | Sequence[str]) -> list[str]:
    """'name (Type)' of the modules with a 2-D weight of their own that ``optim_target_modules``
    selects but that are not ``nn.Linear`` (GPT-2's ``Conv1D``, embeddings): left out, as the
    Trainer's GaLore leaves them out."""
    return [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
            if not isinstance(module, nn.Linear) and target_module_matches(optim_target_modules, name)
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.ndim == 2]


def target_parameter_names(model: nn.Module, optim_target_modules: str | Sequence[str]) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the trainable weights that Fira projects.

    The weight of every ``nn.Linear`` whose module name :func:`target_module_matches`, that
    requires grad and is 2-D. Raises ``ValueError`` when nothing matches; a list entry that
    selects none of them (a typo, ``'v_prj'``; a layer that is not ``nn.Linear``) gets a
    ``UserWarning`` naming it: the Trainer's rule skips it without a word, and the layers it
    was meant for are not projected.
    """
    _check_target_modules(optim_target_modules)
    wanted: dict[str, str] = {}  # weight name -> module name
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and target_module_matches(optim_target_modules, module_name):
            wanted[f"{module_name}.weight" if module_name else "weight"] = module_name
    names = [n for n, p in model.named_parameters() if n in wanted and p.requires_grad and p.ndim == 2]
    if not names:
        why = ""
        single = isinstance(optim_target_modules, str) and not _is_all_linear(optim_target_modules)
        if single and any(optim_target_modules in n for n, m in model.named_modules() if isinstance(m, nn.Linear)):
            why += (f"; a string is a regular expression that must match the whole module name: for the modules "
                    f"whose name contains {optim_target_modules!r} give a list, [{optim_target_modules!r}], "
                    f"or r'.*{optim_target_modules}'")
        others = _not_linear(model, optim_target_modules)
        if others:
            why += f"; it matches modules that are not nn.Linear, left out as by the Trainer's GaLore: {others[:6]}"
        raise ValueError(
            f"optim_target_modules={optim_target_modules!r} matches no trainable nn.Linear weight of "
            f"{type(model).__name__}{why}; linear modules are e.g. "
            f"{[n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:6]}"
        )
    if not isinstance(optim_target_modules, str):
        selected = [wanted[n] for n in names]
        idle = [e for e in optim_target_modules if not any(target_module_matches([e], m) for m in selected)]
        if idle:
            others = _not_linear(model, idle)
            warnings.warn(
                f"optim_target_modules={list(optim_target_modules)!r}: the entries {idle!r} select no trainable "
                f"nn.Linear weight of {type(model).__name__} (the others select {len(names)})"
                + (f"; they match modules that are not nn.Linear, left out as by the Trainer's GaLore: {others[:6]}"
                   if others else "; the layers they were meant for are not projected"),
                UserWarning, stacklevel=2)
    return names


def trainer_param_groups(
    model: nn.Module,
    optim_target_modules: str | Sequence[str],
    *,
    weight_decay: float = 0.0,
    decay_parameter_names: Iterable[str] | None = None,
    **fira_options: Any,
) -> list[dict[str, Any]]:
    """Param groups for :class:`FiraAdamW`: the projected weights and the rest, each split by decay.

    ``[{"params": projected decayed, "weight_decay": wd, **fira_options}, {"params": other decayed,
    "rank": None, "weight_decay": wd}, {"params": other not decayed, "rank": None, "weight_decay": 0},
    {"params": projected not decayed, "weight_decay": 0, **fira_options}]`` (empty groups dropped:
    the last one is there only for a decay list that leaves out a projected weight).
    ``decay_parameter_names`` defaults to every parameter with two or more dimensions (biases and
    norm gains are not decayed); ``FiraTrainer`` passes the Trainer's own list. A name that is no
    parameter of ``model`` is a ``ValueError``. Frozen parameters are left out.
    """
    projected = set(target_parameter_names(model, optim_target_modules))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decay_parameter_names is None:
        decay = {n for n, p in trainable if p.ndim >= 2}
    else:
        if isinstance(decay_parameter_names, str):  # a set of its characters: nothing decayed
            raise TypeError(f"decay_parameter_names must be a list of parameter names, got "
                            f"{decay_parameter_names!r}")
        decay = set(decay_parameter_names)
        # A misspelt name decayed nothing, without a word. Every name a module registers counts, as
        # in the Trainer's own list (get_parameter_names): a tied weight's second name, an unset bias.
        known = {f"{m}.{k}" if m else k for m, module in model.named_modules(remove_duplicate=False)
                 for k in module._parameters}
        unknown = sorted(decay - known)
        if unknown:
            raise ValueError(f"decay_parameter_names names no parameter of {type(model).__name__}: {unknown[:6]}"
                             f"{f' (and {len(unknown) - 6} more)' if len(unknown) > 6 else ''}; the names are "
                             f"those of model.named_parameters(), e.g. {[n for n, _ in trainable[:3]]}")
    groups = [
        {"params": [p for n, p in trainable if n in projected and n in decay], "weight_decay": weight_decay,
         **fira_options},
        # after the plain groups: a decay list that leaves every projected weight in has none here,
        # and the groups (and the checkpoints' group indices) are those they always were
        {"params": [p for n, p in trainable if n not in projected and n in decay], "rank": None,
         "weight_decay": weight_decay},
        {"params": [p for n, p in trainable if n not in projected and n not in decay], "rank": None,
         "weight_decay": 0.0},
        {"params": [p for n, p in trainable if n in projected and n not in decay], "weight_decay": 0.0,
         **fira_options},
    ]
    return [g for g in groups if g["params"]]


def _variant_options(variant: str) -> dict[str, Any]:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of fira_optim.VARIANTS: {sorted(VARIANTS)}")
    return dict(VARIANTS[variant])


def _resolve(
    model: nn.Module,
    args: Any | None,
    *,
    optim_target_modules: str | Sequence[str] | None,
    optim_args: str | dict[str, Any] | None,
    variant: str,
    lr: float | None,
    betas: tuple[float, float] | None,
    eps: float | None,
    weight_decay: float | None,
    decay_parameter_names: Iterable[str] | None,
    fira_options: dict[str, Any],
) -> dict[str, Any]:
    """Keyword arguments of FiraAdamW (``params`` included): explicit keywords > optim_args > args."""
    targets = optim_target_modules if optim_target_modules is not None else getattr(args, "optim_target_modules", None)
    parsed = parse_optim_args(optim_args if optim_args is not None else getattr(args, "optim_args", None))
    options = {**_variant_options(variant), **parsed, **_parse_options(fira_options, "fira_options")}
    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if args is not None:
        defaults = {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay,
        }
        # The run's seed draws the random projectors and the stochastic rounding, as it draws
        # everything else of the run (every TrainingArguments.seed drew the same bits).
        if isinstance(getattr(args, "seed", None), int) and "seed" not in options:
            options["seed"] = args.seed
    lr = defaults["lr"] if lr is None else lr
    betas = defaults["betas"] if betas is None else betas
    eps = defaults["eps"] if eps is None else eps
    weight_decay = defaults["weight_decay"] if weight_decay is None else weight_decay
    # The projected group carries its rank explicitly (a group is projected iff its rank is not None);
    # every other option is an optimizer default, so variants that change the base optimizer reach
    # all groups the way the library defines them.
    rank = options.pop("rank", _fira_keyword_defaults().get("rank"))
    if rank is None:
        raise ValueError("rank=None would project nothing; give a positive rank (optim_args='rank=64')")
    groups = trainer_param_groups(
        model, targets, weight_decay=weight_decay, decay_parameter_names=decay_parameter_names, rank=rank
    )
    return {"params": groups, "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, **options}


def create_fira_optimizer(
    model: nn.Module,
    args: Any | None = None,
    *,
    optim_target_modules: str | Sequence[str] | None = None,
    optim_args: str | dict[str, Any] | None = None,
    variant: str = "fira",
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    decay_parameter_names: Iterable[str] | None = None,
    **fira_options: Any,
) -> FiraAdamW:
    """A :class:`FiraAdamW` over ``model``'s trainable parameters, configured like a Trainer run.

    Args:
        model: the model (a ``peft`` model too: frozen weights are skipped).
        args: a ``TrainingArguments`` (or any object with ``learning_rate``, ``adam_beta1``,
            ``adam_beta2``, ``adam_epsilon``, ``weight_decay`` and optionally
            ``optim_target_modules`` / ``optim_args``); ``None``: ``lr=1e-3``, ``betas=(0.9, 0.999)``,
            ``eps=1e-8`` (torch's AdamW defaults) and ``weight_decay=0`` (torch's AdamW: 0.01).
        optim_target_modules: overrides ``args.optim_target_modules`` (see module doc).
        optim_args: overrides ``args.optim_args``: ``"rank=64,update_proj_gap=100,alpha=0.25"``.
        variant: a name of :data:`fira_optim.VARIANTS` (``"fira"``, ``"galore"``, ablations...)
            whose overrides are applied first.
        lr, betas, eps, weight_decay: override the values read from ``args``. ``seed`` (random
            projectors, stochastic rounding) is ``args.seed`` unless ``optim_args`` or a keyword
            gives one.
        decay_parameter_names: parameters that receive weight decay (default: the >= 2-D ones).
        **fira_options: any other FiraAdamW keyword (``rank=16``, ``alpha=1.0``, ...) for the
            projected group; they win over ``optim_args``.
    """
    kwargs = _resolve(
        model, args, optim_target_modules=optim_target_modules, optim_args=optim_args, variant=variant, lr=lr,
        betas=betas, eps=eps, weight_decay=weight_decay, decay_parameter_names=decay_parameter_names,
        fira_options=fira_options,
    )
    params = kwargs.pop("params")
    return FiraAdamW(params, **kwargs)


def create_fira_optimizer_and_scheduler(
    model: nn.Module,
    args: Any,
    num_training_steps: int,
    **kwargs: Any,
) -> tuple[FiraAdamW, torch.optim.lr_scheduler.LRScheduler]:
    """``(optimizer, scheduler)`` for ``Trainer(optimizers=(optimizer, scheduler))``.

    The scheduler is the one the Trainer would build: ``transformers.get_scheduler(
    args.lr_scheduler_type, warmup=args.get_warmup_steps(num_training_steps), ...)``.
    ``num_training_steps`` must equal the Trainer's (``args.max_steps`` when set). Other keywords
    go to :func:`create_fira_optimizer`.
    """
    if not isinstance(num_training_steps, int) or num_training_steps <= 0:
        raise ValueError(f"num_training_steps={num_training_steps!r} must be a positive int")
    optimizer = create_fira_optimizer(model, args, **kwargs)
    scheduler = transformers.get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=getattr(args, "lr_scheduler_kwargs", None) or {},
    )
    return optimizer, scheduler


def fira_optimizer_cls_and_kwargs(model: nn.Module, args: Any, **kwargs: Any) -> tuple[type[FiraAdamW], dict]:
    """``(FiraAdamW, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)`` (``params`` inside kwargs).

    One Trainer per call: the Trainer takes ``params`` out of the dict when it builds the
    optimizer, and a second Trainer given the same dict builds FiraAdamW over its own param
    groups, which set no rank: nothing projected. Call this again for another Trainer."""
    return FiraAdamW, _resolve(
        model, args,
        optim_target_modules=kwargs.pop("optim_target_modules", None),
        optim_args=kwargs.pop("optim_args", None),
        variant=kwargs.pop("variant", "fira"),
        lr=kwargs.pop("lr", None), betas=kwargs.pop("betas", None), eps=kwargs.pop("eps", None),
        weight_decay=kwargs.pop("weight_decay", None),
        decay_parameter_names=kwargs.pop("decay_parameter_names", None),
        fira_options=kwargs,
    )


class FiraTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is :class:`FiraAdamW`.

    The TrainingArguments' ``optim_target_modules`` and ``optim_args`` configure it (``optim``
    itself is ignored; ``optimizer_cls_and_kwargs``, which it would ignore too, is refused). ``fira_options`` (a dict of FiraAdamW keywords, plus ``variant``,
    ``optim_target_modules`` or ``optim_args``) overrides them::

        FiraTrainer(model=model, args=args, train_dataset=ds,
                    fira_options={"variant": "fira", "rank": 16, "optim_target_modules": ["lora_A", "lora_B"]})

    ``step_in_backward=True`` updates each parameter inside the backward pass
    (:func:`fira_optim.step_in_backward`), so the model's full gradients never coexist. The
    Trainer's gradient accumulation then runs the backward passes of the non-final micro-batches
    under the handle's ``accumulate()`` (the weights equal those of the usual step). It needs
    ``max_grad_norm=0`` (global-norm clipping cannot work when each gradient is freed as it is
    used; Fira's limiter bounds each matrix's update instead; refused otherwise), and the logs
    then have no ``grad_norm`` (the norm of freed gradients would read 0). Where the
    Trainer would scale the loss (fp16 mixed precision, ``fp16=True`` or accelerate's
    ``--mixed_precision fp16``, on a GPU) the handle's own
    :class:`~fira_optim.loss_scale.LossScale` takes the place of its GradScaler:
    each update divides its own gradients, an overflow skips the updates whose gradients
    overflowed while the step (and the schedule) goes on, so ``optimizer_step_was_skipped`` stays
    False; the scale is saved as the Trainer's ``scaler.pt``. Under DDP (``torchrun``, ``accelerate launch``;
    also with ``torch_compile``) each update runs on the all-reduced gradients, in DDP's
    communication hook, and saves the optimizer's temporaries, not the gradients (DDP's buckets
    hold them). Several processes without a DDP wrapper (FSDP, DeepSpeed, tensor parallelism)
    are refused (for FSDP2 use ``fira-train --parallel fsdp2`` or :func:`fira_optim.step_in_backward`
    in your own loop). ``in_backward`` is the handle once training has started: the hooks go on
    the model and optimizer as the Trainer prepared them, move when it replaces either, and are
    removed when ``train()`` returns (a handle the optimizer came with is left to its owner).
    """

    def __init__(self, *args: Any, fira_options: dict[str, Any] | None = None, step_in_backward: bool = False,
                 **kwargs: Any) -> None:
        self.fira_options = dict(fira_options or {})
        self.step_in_backward = bool(step_in_backward)
        self.in_backward: Any = None
        self._own_handle: Any = None  # the handle this Trainer made (not one the optimizer came with)
        super().__init__(*args, **kwargs)
        given = getattr(self, "optimizer_cls_and_kwargs", None)
        if given is not None:
            # create_optimizer builds FiraAdamW from the arguments: the class and its keywords (those of
            # fira_optimizer_cls_and_kwargs too: a variant, a rank) would train nothing, without a word
            cls = getattr(given[0], "__name__", given[0]) if isinstance(given, (tuple, list)) and given else given
            raise ValueError(
                f"FiraTrainer builds its FiraAdamW from the TrainingArguments and fira_options: "
                f"optimizer_cls_and_kwargs=({cls}, ...) would be ignored; give its options as "
                "fira_options={'variant': ..., 'rank': ...}, an optimizer as optimizers=(optimizer, None), "
                "or optimizer_cls_and_kwargs to transformers.Trainer")
        if self.step_in_backward:
            _check_step_in_backward(self)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Where accelerate scales the loss: fp16 mixed precision (fp16=True, or `accelerate launch
        # --mixed_precision fp16`, which leaves args.fp16 False) on an accelerator (on the CPU it
        # runs fp16 as fp32, unscaled, and so does this Trainer then)
        if self.step_in_backward and getattr(self.accelerator, "scaler", None) is not None:
            # before accelerate wraps the optimizer (it hands the wrapper its scaler then), and
            # before a checkpoint's scaler.pt is loaded into it; a new accelerator (a new
            # hyperparameter-search trial) starts a new scale, as it would a new GradScaler
            self.accelerator.scaler = _ScalerInBackward(LossScale())

    @property
    def _loss_scale(self) -> LossScale | None:
        """The scale the handle takes under fp16 mixed precision (None: no loss scaling)."""
        scaler = getattr(getattr(self, "accelerator", None), "scaler", None)
        return scaler.loss_scale if isinstance(scaler, _ScalerInBackward) else None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """None while the updates run in the backward pass: the gradients were used and freed by
        then, so the Trainer's norm of them would read 0 (with ``max_grad_norm=0``, transformers
        5 measures it after the backward pass); the log then has no ``grad_norm``."""
        if self.in_backward is not None and grad_norm is None:
            return None
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            options = dict(self.fira_options)
            # the Trainer's rule (no decay for biases and norms), unless fira_options gives its own list
            options.setdefault("decay_parameter_names", self.get_decay_parameter_names(opt_model))
            self.optimizer = create_fira_optimizer(opt_model, self.args, **options)
        return self.optimizer

    def _hook_in_backward(self, model: nn.Module) -> None:
        """The handle on the optimizer and model that training uses now: the Trainer wraps the
        model in DDP after the optimizer exists (and again after ``auto_find_batch_size`` lowers
        the batch size), and DDP's hook needs the wrapper. The handle it holds (made by it, or
        one the optimizer came with) is replaced when it hooks an earlier optimizer or wrapper.
        The TrainingArguments are checked again, at each step: they may change after ``__init__``
        (a ``hyperparameter_search`` trial sets them in ``train()``), and ``max_grad_norm > 0``
        would clip the freed gradients and log a norm of 0."""
        _check_step_in_backward(self)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if not isinstance(optimizer, Fira):  # also an optimizer given to the Trainer
            raise ValueError(f"FiraTrainer(step_in_backward=True) needs a fira_optim optimizer, got "
                             f"{type(optimizer).__name__}")
        inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP model (torch_compile=True)
        ddp = inner if isinstance(inner, nn.parallel.DistributedDataParallel) else None
        if ddp is None and self.args.world_size > 1:
            raise ValueError(
                f"FiraTrainer(step_in_backward=True) with world_size={self.args.world_size} needs the model "
                f"wrapped in DistributedDataParallel, got {type(inner).__name__}: each update must use the "
                "all-reduced gradient (tensor parallelism, XLA and SageMaker are not supported)")

        def fits(handle: Any) -> bool:  # hooks this optimizer, and this DDP wrapper under DDP
            return (handle.optimizer is optimizer and optimizer._in_backward is handle
                    and (handle.model is ddp or not (handle._ddp or ddp is not None)))

        if self.in_backward is not None:
            if fits(self.in_backward):
                return
            self.in_backward.remove()  # the Trainer has replaced the optimizer or the DDP wrapper since
            self.in_backward = None
        handle = optimizer._in_backward  # None, or a handle made before the Trainer saw the optimizer
        if handle is None:
            handle = self._own_handle = step_in_backward(optimizer, ddp, loss_scale=self._loss_scale)
        elif self._loss_scale is not None and handle.loss_scale is not self._loss_scale:
            raise ValueError("FiraTrainer(step_in_backward=True) under fp16 mixed precision scales the loss itself: "
                             "the optimizer already has a step_in_backward handle; remove() it and let the Trainer "
                             "hook the optimizer")
        elif not fits(handle):
            raise ValueError(
                "FiraTrainer(step_in_backward=True): the optimizer already updates in the backward pass "
                f"for {'a DDP model' if handle._ddp else 'one process'}, but the Trainer trains "
                f"{'this DDP model' if ddp is not None else 'in one process'}; remove() that handle and let "
                "the Trainer hook the optimizer")
        self.in_backward = handle

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:  # its hooks stay on the model's weights no longer: another Trainer may train them
            if self._own_handle is not None:
                self._own_handle.remove()
                self._own_handle = None

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.step_in_backward:
            self._hook_in_backward(model)
        # The Trainer marks the last micro-batch of each accumulation (sync_gradients) before
        # this runs: the others accumulate their gradients and update nothing.
        if self.in_backward is not None and not self.accelerator.sync_gradients:
            with self.in_backward.accumulate():
                return super().training_step(model, inputs, *args, **kwargs)
        return super().training_step(model, inputs, *args, **kwargs)


class _ScalerInBackward:
    """What accelerate asks of the Trainer's ``GradScaler`` under fp16 mixed precision, for updates in
    the backward pass: the loss is scaled by the handle's :class:`~fira_optim.loss_scale.LossScale`,
    each update divides its own gradients by it, and ``optimizer.step()`` moves it (GradScaler
    would find the gradients used and freed). Its state is the Trainer's ``scaler.pt``."""

    def __init__(self, loss_scale: LossScale) -> None:
        self.loss_scale = loss_scale

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.loss_scale.scale(outputs)

    def unscale_(self, optimizer: Any) -> None:
        """Nothing: each update divided its own gradients (the Trainer clips none: max_grad_norm=0)."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)  # an overflow skipped its own updates in the backward pass

    def update(self, new_scale: Any = None) -> None:
        """Nothing: ``optimizer.step()`` moved the scale."""

    def get_scale(self) -> float:
        return self.loss_scale.get_scale()

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.loss_scale.state_dict()  # GradScaler's keys: a GradScaler reads it too

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scale.load_state_dict(state)


def _check_step_in_backward(trainer: Trainer) -> None:
    """ValueError naming the TrainingArguments that updates in the backward pass cannot honour."""
    args = trainer.args
    if args.max_grad_norm:
        raise ValueError(
            f"FiraTrainer(step_in_backward=True) needs TrainingArguments(max_grad_norm=0), got "
            f"max_grad_norm={args.max_grad_norm!r}: clipping by the global norm cannot work when each "
            "gradient is used and freed as backward computes it (Fira's norm-growth limiter bounds each "
            "matrix's update instead)")
    for name, on in (("FSDP", trainer.is_fsdp_enabled), ("DeepSpeed", trainer.is_deepspeed_enabled)):
        if on:
            raise ValueError(
                f"FiraTrainer(step_in_backward=True) cannot run under {name}, which takes over the "
                "model's parameters and gradients (the hooks would miss them); train under DDP or in one process, "
                "or use fira_optim.step_in_backward in your own FSDP2 loop (`fira-train --parallel fsdp2`)")
