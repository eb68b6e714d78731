"""A fine-tuning run's options (:class:`FinetuneConfig`, one per CLI option) and the methods.

Importing this module loads no torch: the ``finetune`` parser is built from it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fira_train.finetune.commonsense import TaskSpec, parse_tasks

#: The entries of the method registry (:data:`fira_train.methods.registry.METHODS`) that
#: fine-tuning offers, under the same names; it runs them through the Hugging Face ``Trainer``
#: (``galore`` and ``fira`` through :class:`fira_optim.integrations.FiraTrainer`; the paper's
#: fine-tuning baselines ``apollo`` (its MMLU table), ``flora`` and ``slimadam`` (its commonsense
#: tables) with their optimizer built by :mod:`fira_train.finetune.train`). The registry itself is
#: not imported here: it loads torch.
REGISTRY_METHODS = ("adamw", "lora", "galore", "fira", "apollo", "flora", "slimadam")
#: ``--method``: a view of the registry, :data:`REGISTRY_METHODS` and two methods only fine-tuning
#: has: ``none`` (zero-shot, no training) and ``fira-lora`` (the released recipe: ``lora``'s
#: adapters trained by Fira).
METHODS = ("none", *REGISTRY_METHODS, "fira-lora")
LORA_METHODS = ("lora", "fira-lora")
FIRA_METHODS = ("galore", "fira", "fira-lora")
#: The paper's other baselines (their optimizers come from :mod:`fira_train.methods`).
PEER_METHODS = ("apollo", "flora", "slimadam")

#: Learning rate per method when ``--lr`` is not given, set for short CPU runs (tens to hundreds of
#: steps): LoRA's B starts at zero and needs a larger step than full fine-tuning of pretrained
#: weights (LLM-Adapters uses 3e-4 for LoRA; the paper 1e-4 for every method over 3 epochs).
#: The peers take AdamW's step: SlimAdam is AdamW with a coarser second moment; APOLLO's update
#: is Adam-sized with the fine-tuning scale d/r its README uses (see :mod:`fira_train.finetune.train`);
#: Flora's Adafactor step is relative to the weights' RMS (~0.02-0.05 in a pretrained LLaMA), so
#: 1e-3 gives an absolute step of that order (an estimate, not measured on the packaged model).
DEFAULT_LR = {"adamw": 5e-5, "galore": 5e-5, "fira": 5e-5, "lora": 5e-4, "fira-lora": 5e-4, "none": 0.0,
              "apollo": 5e-5, "flora": 1e-3, "slimadam": 5e-5}
#: Projection rank when ``--rank`` is not given: the paper's r = 32 (for every method of its
#: fine-tuning table, Flora included); the released Fira-on-LoRA uses 16.
DEFAULT_RANK = {"galore": 32, "fira": 32, "fira-lora": 16, "apollo": 32, "flora": 32}

#: ``--state-dtype``: how the Fira-family methods store their optimizer states (the library's
#: ``FiraAdamW(state_dtype=...)`` values; kept here, where torch is not imported).
STATE_DTYPES = ("float32", "bfloat16", "int8")
#: ``--state-rounding``: how the moments are written into bf16 states (``FiraAdamW(state_rounding=...)``).
STATE_ROUNDINGS = ("nearest", "stochastic")

#: ``--threads`` at most: :data:`fira_train.config.run_config.MAX_THREADS` (``train.num_threads``'s
#: cap, kept here, where torch is not imported): a count the process cannot start crashed it.
MAX_THREADS = 1024

#: ``--scoring``: ``loglik`` (default) picks the option of largest log-likelihood, as lm-eval does
#: (:mod:`fira_train.finetune.loglik`); ``generate`` is the paper's protocol: generate (greedily; the
#: released script uses 4 beams), then extract the answer label (:mod:`fira_train.finetune.evaluate`).
SCORINGS = ("loglik", "generate")

#: ``--recipe``: named settings, the option values each one fixes. ``released`` is the Fira
#: authors' fine-tuning script (``fine_tuning/ft_fira.sh``): LoRA adapters r = 32, lora_alpha = 64,
#: dropout 0.05 on q,k,v,up,down, trained by Fira at rank 16 (scale 1, subspace refreshed every
#: 200 steps) at lr 1e-4. The budget (steps, batch, warm-up) is not part of a recipe.
RECIPES: dict[str, dict[str, object]] = {
    "released": {"method": "fira-lora", "lr": 1e-4, "rank": 16, "alpha": 1.0, "update_proj_gap": 200,
                 "lora_r": 32, "lora_alpha": 64, "lora_dropout": 0.05,
                 "lora_targets": "q_proj,k_proj,v_proj,up_proj,down_proj"},
}


class FinetuneError(ValueError):
    """A bad option value; the message names the option and the value."""


def non_finite_scores(task: str, what: str, broken: int, total: int, first: object) -> FinetuneError:
    """The refusal of a scoring whose ``what`` (with its verb: "the model's next-token scores are",
    "... log-likelihood of an answer is") is not finite for ``broken`` of ``total`` examples: an
    accuracy from the argmax of NaNs would be noise."""
    return FinetuneError(f"{task}: {what} not finite for {broken} of {total} examples (the first: index "
                         f"{first}): its weights are not finite or its activations overflowed (fp16: try "
                         "--precision bf16 or fp32); no accuracy is reported")


#: The options only training reads (a zero-shot run's record holds None for each).
TRAINING_OPTIONS = ("batch_size", "max_train", "weight_decay", "cutoff_len", "train_on_inputs", "save_steps",
                    "precision")
#: How the training runs (the Trainer's ``bf16`` / ``fp16`` mixed precision, or fp32 throughout).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class FinetuneConfig:
    """One fine-tuning run. Every field is a CLI option (``--max-eval`` for ``max_eval``, ...)."""

    tasks: list[str]
    """Task names (folder names under ``data_dir``); those with records in ``train.json`` are trained on."""
    data_dir: str
    """Folder holding ``<task>/train.json`` and ``<task>/test.json`` in the LLM-Adapters format."""
    method: str | None = None
    """One of :data:`METHODS`; ``None``: the recipe's, else ``fira``."""
    recipe: str | None = None
    """A named setting of :data:`RECIPES`: fills ``method``, ``lr`` and ``rank`` when they are not
    given and refuses option values that contradict it."""
    scoring: str = "loglik"
    """One of :data:`SCORINGS`."""
    model: str | None = None
    """Hub name, local folder or .gguf file; ``None``: the packaged SmolLM2-135M-Instruct."""
    steps: int = 100
    """Optimizer steps (0: zero-shot evaluation)."""
    max_eval: int | None = 500
    """Test examples per task (a seeded random subset; all of a smaller test set); ``None``: all."""
    max_val: int = 0
    """Validation examples per trained-on task, held out of the training pool (never trained on,
    never tested: :func:`fira_train.finetune.data.load_validation`); a swept learning rate is chosen
    on their accuracy. 0: none."""
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
    """Fira/GaLore/APOLLO projection rank, Flora's compression rank; ``None``: :data:`DEFAULT_RANK`."""
    update_proj_gap: int = 200
    """Steps between subspace refreshes (Fira/GaLore; APOLLO's and Flora's random projections)."""
    alpha: float = 1.0
    """Fira/GaLore scale: 1 keeps the update on the same scale as Adam's, so one lr serves all."""
    target_modules: str = "all-linear"
    """Weights Fira/GaLore/APOLLO project in full fine-tuning (``optim_target_modules``: comma list,
    ``all-linear``, or a regex when it contains regex characters)."""
    lora_r: int = 32
    lora_alpha: int = 64
    lora_dropout: float = 0.05
    lora_targets: str = "q_proj,k_proj,v_proj,up_proj,down_proj"
    cutoff_len: int = 256
    train_on_inputs: bool = True
    """Loss on the prompt tokens too (LLM-Adapters' default)."""
    max_new_tokens: int = 32
    """Generated tokens per answer (``scoring="generate"`` only)."""
    eval_batch_size: int = 16
    seed: int = 42
    threads: int | None = None
    """torch threads (``torch.set_num_threads``); ``None``: torch's default."""
    overwrite: bool = False
    """Replace the results of an earlier run in ``out`` (otherwise an existing ``results.json`` is an error)."""
    save_steps: int = 50
    """Save a training checkpoint every ``save_steps`` steps in ``out/trainer`` (the newest kept);
    the same run started again continues from it. 0: no checkpoints."""
    step_in_backward: bool = False
    """Fira-family methods: update each weight inside the backward pass
    (:func:`fira_optim.step_in_backward`), so the full gradients never coexist; such a run clips
    no gradients (the others clip at the global norm 1.0, the Trainer's default)."""
    state_dtype: str = "float32"
    """Fira-family methods: how the optimizer states are stored (:data:`STATE_DTYPES`)."""
    state_rounding: str = "nearest"
    """Fira-family methods: how the moments are written into bf16 states (:data:`STATE_ROUNDINGS`;
    "stochastic" needs ``state_dtype="bfloat16"``)."""
    precision: str = "fp32"
    """The training's precision (:data:`PRECISIONS`): fp32 throughout, as the Trainer's default, or
    its bf16 / fp16 mixed precision (fp32 weights; fp16 with loss scaling, for GPUs without bf16)."""
    task_specs: list[TaskSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.recipe is not None:
            self._apply_recipe()
        if self.method is None:
            self.method = "fira"
        if self.method not in METHODS:
            raise FinetuneError(f"method={self.method!r} must be one of {', '.join(METHODS)}")
        if self.scoring not in SCORINGS:
            raise FinetuneError(f"scoring={self.scoring!r} must be one of {', '.join(SCORINGS)}")
        self.task_specs = parse_tasks(self.tasks)
        self.tasks = [spec.name for spec in self.task_specs]
        positive = {"batch_size": self.batch_size, "cutoff_len": self.cutoff_len, "lora_r": self.lora_r,
                    "max_new_tokens": self.max_new_tokens, "eval_batch_size": self.eval_batch_size,
                    "update_proj_gap": self.update_proj_gap}
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise FinetuneError(f"{name}={value!r} must be a positive integer")
        for name in ("steps", "max_eval", "max_val", "max_train", "warmup_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise FinetuneError(f"{name}={value!r} must be a non-negative integer")
        if self.max_eval == 0:
            raise FinetuneError("max_eval=0 would evaluate nothing; give --max-eval all to evaluate every example "
                                "(left out, it is 500)")
        if self.max_train == 0 and self.trains:
            raise FinetuneError("max_train=0 would train on nothing; leave it out for one pass (steps x batch size)")
        if self.max_val and not self.trains:
            raise FinetuneError(f"max_val={self.max_val}: validation records are the training records a run does not "
                                f"train on, and a zero-shot run (method 'none' or steps 0) chooses nothing on them; "
                                f"leave --max-val out")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise FinetuneError(f"lr={self.lr!r} must be a positive finite number")
        if self.rank is not None and self.rank <= 0:
            raise FinetuneError(f"rank={self.rank!r} must be a positive integer")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise FinetuneError(f"weight_decay={self.weight_decay!r} must be a non-negative finite number")
        for name in ("alpha", "lora_alpha"):  # a scale of 0 would leave the update (or adapters) out
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise FinetuneError(f"{name}={value!r} must be a positive finite number")
        if not (0.0 <= self.lora_dropout < 1.0):
            raise FinetuneError(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise FinetuneError(f"threads={self.threads!r} must be an integer in [1, {MAX_THREADS}]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 2**32 - 1:
            # numpy's generators take no more: its own error named no argument, after the model loaded
            raise FinetuneError(f"seed={self.seed!r} must be an integer in [0, {2**32 - 1}]")
        if self.out == "":
            raise FinetuneError("out='' names no folder: give a path, or leave --out out for runs/finetune/<method>")
        self._refuse_out_in_the_data()
        if self.state_dtype not in STATE_DTYPES:
            raise FinetuneError(f"state_dtype={self.state_dtype!r} must be one of {', '.join(STATE_DTYPES)}")
        if self.state_rounding not in STATE_ROUNDINGS:
            raise FinetuneError(f"state_rounding={self.state_rounding!r} must be one of {', '.join(STATE_ROUNDINGS)}")
        if self.state_rounding == "stochastic" and self.state_dtype != "bfloat16":
            raise FinetuneError(f"state_rounding='stochastic' rounds bf16 states: it needs state_dtype='bfloat16', "
                                f"not state_dtype={self.state_dtype!r}")
        if self.precision not in PRECISIONS:
            raise FinetuneError(f"precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        fira_only = {"step_in_backward": self.step_in_backward, "state_dtype": self.state_dtype != "float32",
                     "state_rounding": self.state_rounding != "nearest"}
        for name, given in fira_only.items():
            if given and self.trains and self.method not in FIRA_METHODS:
                raise FinetuneError(f"{name}={getattr(self, name)!r} is an option of the Fira-family methods "
                                    f"({', '.join(FIRA_METHODS)}), not of method={self.method!r}")
        self._check_module_names()

    def _check_module_names(self) -> None:
        """FinetuneError for a ``target_modules`` or ``lora_targets`` the method uses that selects
        no module whatever the model (a regex that does not compile, a list of no names): they
        were refused only once the model had loaded. Names that match none of the model's modules
        are refused then, as the model is needed to tell."""
        used = self.used_options()
        if used["target_modules"] is not None:
            targets = self.optim_target_modules()
            if isinstance(targets, str) and targets != "all-linear":
                try:
                    re.compile(targets)
                except re.error as err:
                    raise FinetuneError(f"target_modules={self.target_modules!r}: not a valid regular expression "
                                        f"({err}); give all-linear, a comma list of module names or a regex") from None
            elif not targets:
                raise FinetuneError(f"target_modules={self.target_modules!r} names no module: give all-linear, a "
                                    "comma list of module names or a regex")
        if used["lora_targets"] is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise FinetuneError(f"lora_targets={self.lora_targets!r} names no module: give a comma list of module "
                                "names, e.g. q_proj,v_proj")

    def _refuse_out_in_the_data(self) -> None:
        """FinetuneError where ``out`` is the data folder or one of its tasks' folders (``--out`` and
        ``--data-dir`` swapped, or a path copied from the other): the run wrote its results.json,
        predictions/ and trainer/ checkpoints among the task sets, a folder often shared and read-only
        to everyone but its owner (root wrote there regardless)."""
        data = os.path.realpath(Path(self.data_dir).expanduser())
        out = os.path.realpath(self.out_dir.expanduser())
        # a task's folder may be a link (to a shared copy of its set): compared where it leads
        folders = {data: "the data folder",
                   **{os.path.realpath(os.path.join(data, task)): f"the folder of task {task!r} in the data"
                      for task in self.tasks}}
        if out in folders:
            raise FinetuneError(f"out={str(self.out_dir)!r} is {folders[out]} (data_dir={self.data_dir!r}): the "
                                "run's results, predictions and checkpoints would be written among the task sets; "
                                "choose an --out outside it")

    def _apply_recipe(self) -> None:
        if self.recipe not in RECIPES:
            raise FinetuneError(f"recipe={self.recipe!r} must be one of {', '.join(RECIPES)}")
        for name, value in RECIPES[self.recipe].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
            elif getattr(self, name) != value:
                raise FinetuneError(f"recipe={self.recipe!r} fixes {name}={value!r}, but "
                                    f"{name}={getattr(self, name)!r} was given: leave the option out, or drop the "
                                    f"recipe")

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
        """The rank the method trains with; None for a method without one (a --rank given to it
        is not used)."""
        method = self.effective_method
        if method not in DEFAULT_RANK:
            return None
        return self.rank if self.rank is not None else DEFAULT_RANK[method]

    def used_options(self) -> dict[str, Any]:
        """The method's own options as the run uses them, None for those it does not use (a
        results record says what trained, not what was typed); for a run that trains nothing
        (zero-shot) also ``steps`` 0 and every training option None."""
        method = self.effective_method
        uses = {
            "alpha": method in FIRA_METHODS,
            "update_proj_gap": method in FIRA_METHODS + ("apollo", "flora"),
            "target_modules": method in ("galore", "fira", "apollo"),  # fira-lora: the adapters
            **{key: method in FIRA_METHODS for key in ("step_in_backward", "state_dtype", "state_rounding")},
            **{key: method in LORA_METHODS for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")},
        }
        used = {key: getattr(self, key) if uses_it else None for key, uses_it in uses.items()}
        if not self.trains:
            used.update(dict.fromkeys(TRAINING_OPTIONS), steps=0)
        return {"rank": self.effective_rank, **used}

    def unused_flags(self) -> list[str]:
        """The flags set away from their defaults that this run does not use (:meth:`used_options`:
        another method's options, or a zero-shot run's training options and learning rate), in
        the command line's spelling: a typed ``--state-dtype int8`` that changed nothing is said."""
        defaults = {f.name: f.default for f in fields(self)}
        unused = [name for name, value in self.used_options().items()
                  if value is None and name in defaults and getattr(self, name) != defaults[name]]
        unused += [name for name in ("lr", "warmup_steps") if not self.trains and getattr(self, name) is not None]
        return [f"--{name.replace('_', '-')}" for name in unused]

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
