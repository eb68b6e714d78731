r"""The options of :class:`fira_optim.Fira`: each choice an enum, every group validated once.

Param groups keep plain strings (what ``state_dict`` saves and what users write); the update
reads them through :class:`Hyper`, built from a validated group, whose fields are the enums
below. The enums are ``str`` subclasses, so ``Limiter.GROWTH == "growth"`` holds.
"""

from __future__ import annotations

import difflib
import enum
import functools
import inspect
import math
import numbers
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch


class Choice(str, enum.Enum):
    """An option with a fixed set of string values."""

    @classmethod
    def parse(cls, name: str, value: Any) -> "Choice":
        """The member for ``value``; ``ValueError`` naming the argument ``name`` otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"Invalid {name}: {value!r}; expected one of {cls.values()}") from None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Base(Choice):
    """The adaptive optimizer run on ``R`` (:math:`\\psi`)."""

    ADAM = "adam"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"


class Scaling(Choice):
    """Level of the norm-based scaling factor: per column (Fira), per matrix, or none."""

    COLUMN = "column"
    MATRIX = "matrix"
    NONE = "none"


class Limiter(Choice):
    """Stabiliser of the scaled residual: the norm-growth limiter and the paper's ablations."""

    GROWTH = "growth"
    NONE = "none"
    CLIP = "clip"
    SHRINK = "shrink"
    TENSORWISE = "tensorwise"


class Residual(Choice):
    """What happens to :math:`G - P R`: added scaled (Fira), dropped (GaLore), signSGD (FRUGAL)."""

    ADD = "add"
    DROP = "drop"
    SIGN = "sign"


class Arithmetic(Choice):
    """``paper`` (Algorithm 1) or ``released`` (the ``fira`` 1.0.2 package)."""

    PAPER = "paper"
    RELEASED = "released"


class Projector(Choice):
    """How a basis is found: exact SVD, warm-started subspace iteration, or random."""

    SVD = "svd"
    RANDOMIZED = "randomized"
    RANDOM = "random"


class ProjType(Choice):
    """Which side a matrix is projected on (:func:`fira_optim.projection.projection_side`)."""

    STD = "std"
    REVERSE_STD = "reverse_std"
    LEFT = "left"
    RIGHT = "right"


class Implementation(Choice):
    """Which strategy runs the stages (:mod:`fira_optim.pipeline`)."""

    FAST = "fast"
    COMPILED = "compiled"
    REFERENCE = "reference"


class StateDtype(Choice):
    """How optimizer states are stored (:mod:`fira_optim.precision`)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"


class StateRounding(Choice):
    """How a value formed in fp32 is written into a bf16 optimizer state (:mod:`fira_optim.precision`)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class NonFinite(Choice):
    """What a NaN or Inf gradient does: raise, skip the step, or nothing."""

    ERROR = "error"
    SKIP = "skip"
    IGNORE = "ignore"


BASES = Base.values()
SCALINGS = Scaling.values()
LIMITERS = Limiter.values()
RESIDUALS = Residual.values()
ARITHMETICS = Arithmetic.values()
PROJECTORS = Projector.values()
PROJ_TYPES = ProjType.values()
IMPLEMENTATIONS = Implementation.values()
NONFINITE = NonFinite.values()
STATE_DTYPES = StateDtype.values()
STATE_ROUNDINGS = StateRounding.values()

#: The epsilon that ``fira`` 1.0.2 hard-codes in the scaling factor and the limiter.
RELEASED_EPS = 1e-8


def adam_bias_correction(step: int, beta1: float, beta2: float) -> float:
    r""":math:`b_t = \sqrt{1-\beta_2^t} / (1-\beta_1^t)`."""
    return math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters one update of a group's matrices needs, parsed from the group."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    alpha: float
    gamma: float
    base: Base
    scaling: Scaling
    limiter: Limiter
    residual: Residual
    only_scaling: bool
    arithmetic: Arithmetic
    correct_bias: bool
    clip_norm: float
    mu: float
    state_dtype: StateDtype
    state_rounding: StateRounding
    stochastic_rounding: bool
    seed: int  #: of the stochastic rounding of the states (and weights)

    _CHOICES = {"base": Base, "scaling": Scaling, "limiter": Limiter, "residual": Residual,
                "arithmetic": Arithmetic, "state_dtype": StateDtype, "state_rounding": StateRounding}

    @classmethod
    def from_group(cls, group: dict) -> "Hyper":
        values = {name: group[name] for name in cls.__dataclass_fields__}
        if isinstance(values["lr"], torch.Tensor):  # one element (validate_group)
            values["lr"] = float(values["lr"])
        for name, kind in cls._CHOICES.items():
            values[name] = kind(values[name])
        return cls(**values)

    @property
    def released(self) -> bool:
        return self.arithmetic is Arithmetic.RELEASED

    @property
    def residual_eps(self) -> float:
        # Algorithm 1 uses Adam's epsilon in the scaling factor and the limiter.
        return RELEASED_EPS if self.released else self.eps

    def step_size(self, step: int) -> float:
        """Learning rate multiplying the whole update (bias correction folded in if released)."""
        if self.released and self.correct_bias and self.base is Base.ADAM:
            beta1, beta2 = self.betas
            return self.lr * adam_bias_correction(step, beta1, beta2)
        return self.lr

    def direction_bias_corrected(self) -> bool:
        return self.correct_bias and not self.released

    @property
    def residual_coef(self) -> float:
        r""":math:`k` in :math:`\|g_i - k' P r_i\|^2 = \|g_i\|^2 - k \|r_i\|^2` (orthonormal
        ``P``): 1, or :math:`2\alpha - \alpha^2` for the released residual :math:`G - \alpha P R`."""
        return (2.0 * self.alpha - self.alpha**2) if self.released else 1.0


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is one (Python or NumPy integers, 0-d integer tensors: what
    ``operator.index`` takes), else None; ``bool`` is not an integer here."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_rank(rank: Any) -> int:
    """``rank`` as an int; ``ValueError`` unless it is a positive integer."""
    value = _integer(rank)
    if value is None or value < 1:
        raise ValueError(f"Invalid rank: {rank!r}; expected a positive int (or None for no projection)")
    return value


#: torch.optim.AdamW options that Fira does not implement: a group that turns one on is refused
#: rather than silently trained without it.
TORCH_ONLY = ("maximize", "amsgrad", "capturable", "differentiable")
#: Options of the whole optimizer: a param group that names one is refused (it would be ignored).
CONSTRUCTOR_ONLY = ("nonfinite", "implementation", "split_refresh", "process_group", "host_refresh")


#: The largest float32: a step size above it cannot scale an update of fp32 (or bf16) weights.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def validate_group(g: dict) -> None:
    """Range and choice checks of a group's options; each error names the argument and value."""
    lr = g["lr"]
    if isinstance(lr, torch.Tensor):  # torch.optim.AdamW's rules for a tensor lr
        if g.get("foreach"):
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = float(lr)
    _check_real("lr", lr)
    for key in ("eps", "weight_decay", "alpha", "gamma", "clip_norm", "mu"):
        _check_real(key, g[key])
    # An infinite one of these only makes NaN updates (gamma: inf / inf in the limiter; alpha, lr,
    # weight_decay: inf * 0 somewhere) or none at all (eps); torch.optim.AdamW lets them through.
    # The step sizes lr and alpha scale updates of fp32 weights at least: float32's range bounds them.
    for key, value in (("lr", lr), *((k, g[k]) for k in ("eps", "weight_decay", "alpha", "gamma"))):
        if not math.isfinite(float(value)):
            hint = " (the variant fira-no-limiter is Fira without the limiter)" if key == "gamma" else ""
            raise ValueError(f"Invalid {key}: {value!r}; expected a finite number{hint}")
        if key in ("lr", "alpha") and float(value) > FLOAT32_MAX:
            raise ValueError(f"Invalid {key}: {value!r}; expected at most {FLOAT32_MAX:.4g}, float32's largest "
                             "(the update of fp32 weights cannot be taken with it)")
    betas = g["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__"):
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair of numbers")
    for beta in betas:
        _check_real("betas", beta)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas}; each must be in [0, 1)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate (lr): {g['lr']}")
    if not 0.0 <= g["eps"]:
        raise ValueError(f"Invalid epsilon value (eps): {g['eps']}")
    if not 0.0 <= g["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {g['weight_decay']}")
    gap = _integer(g["update_proj_gap"])
    if gap is None or gap < 1:
        raise ValueError(f"Invalid update_proj_gap: {g['update_proj_gap']!r}; expected an int >= 1")
    g["update_proj_gap"] = gap
    seed = _integer(g["seed"])
    if seed is None:
        raise ValueError(f"Invalid seed: {g['seed']!r}; expected an int")
    g["seed"] = seed
    # NumPy floats (np.float32(1e-3), a sweep's np.logspace value) as Python floats: state_dict()
    # stores the group's values, and a NumPy scalar in it fails torch.load(weights_only=True) (the
    # Hugging Face Trainer's resume). Python numbers and tensors stay as given.
    for key in ("lr", "eps", "weight_decay", "alpha", "gamma", "clip_norm", "mu"):
        g[key] = _python_real(g[key])
    if any(_python_real(beta) is not beta for beta in betas):
        g["betas"] = tuple(_python_real(beta) for beta in betas)
    if not g["alpha"] > 0:
        raise ValueError(f"Invalid alpha: {g['alpha']}; expected > 0")
    if not g["gamma"] >= 1.0:
        raise ValueError(f"Invalid gamma: {g['gamma']}; expected >= 1 (use limiter='none' to disable)")
    if not g["clip_norm"] > 0:
        raise ValueError(f"Invalid clip_norm: {g['clip_norm']}; expected > 0")
    if not 0.0 < g["mu"] <= 1.0:
        raise ValueError(f"Invalid mu: {g['mu']}; expected in (0, 1]")
    for key in ("align_signs", "stochastic_rounding", "correct_bias", "stagger", "only_scaling"):
        if not isinstance(g[key], bool):
            raise ValueError(f"Invalid {key}: {g[key]!r}; expected True or False")
    check_torch_only(g)
    for key in CONSTRUCTOR_ONLY:
        if key in g:
            raise ValueError(f"{key}={g[key]!r} in a param group: {key} is an option of the whole "
                             "optimizer; pass it to the constructor")
    check_state_rounding(g)
    ProjType.parse("proj_type", g["proj_type"])
    Projector.parse("projector", g["projector"])
    arithmetic = Arithmetic.parse("arithmetic", g["arithmetic"])
    base = Base.parse("base", g["base"])
    Scaling.parse("scaling", g["scaling"])
    Limiter.parse("limiter", g["limiter"])
    Residual.parse("residual", g["residual"])
    if arithmetic is Arithmetic.RELEASED and base is not Base.ADAM:
        raise ValueError(f"arithmetic='released' exists only for base='adam', got base={g['base']!r}")
    if not g["correct_bias"] and arithmetic is Arithmetic.PAPER and base is Base.ADAM:
        raise ValueError("correct_bias=False is only available with arithmetic='released'")
    for key in ("foreach", "fused"):
        if g.get(key) is not None and not isinstance(g[key], bool):
            raise ValueError(f"Invalid {key}: {g[key]!r}; expected None, True or False")
    if g.get("fused") and g.get("foreach"):
        raise ValueError("foreach=True and fused=True cannot be set together (as in torch.optim.AdamW)")
    if g.get("fused") and (base is not Base.ADAM or arithmetic is not Arithmetic.PAPER):
        raise ValueError(f"fused=True is torch's fused AdamW: it needs base='adam' and arithmetic='paper', "
                         f"got base={g['base']!r}, arithmetic={g['arithmetic']!r}")


def check_state_rounding(g: dict) -> None:
    """ValueError naming the arguments unless ``g``'s ``state_dtype`` and ``state_rounding`` are
    valid together: stochastic rounding is of bf16 states only. Checked at every step too (as
    :func:`check_torch_only`): the option may change between steps, and one set in
    ``param_groups`` on a group of fp32 or int8 states would otherwise do nothing, without a word;
    so would ``stochastic_rounding="yes"`` (the weights' rounding reads it as true or false)."""
    if not isinstance(g["stochastic_rounding"], bool):
        raise ValueError(f"Invalid stochastic_rounding: {g['stochastic_rounding']!r}; expected True or False")
    state_dtype = StateDtype.parse("state_dtype", g["state_dtype"])
    rounding = StateRounding.parse("state_rounding", g["state_rounding"])
    if rounding is StateRounding.STOCHASTIC and state_dtype is not StateDtype.BFLOAT16:
        raise ValueError(f"Invalid state_rounding: {g['state_rounding']!r} with state_dtype={g['state_dtype']!r}; "
                         "stochastic rounding is of bf16 states: it needs state_dtype='bfloat16' (int8 codes are "
                         "rounded to the nearest map value; with 'float32' only a bf16 parameter that is not "
                         "projected has bf16 moments, rounded to nearest as torch.optim.AdamW's)")


def check_torch_only(g: dict) -> None:
    """ValueError unless ``g`` leaves off the ``torch.optim.AdamW`` options Fira does not implement
    (:data:`TORCH_ONLY`, and ``decoupled_weight_decay=False``). Checked at every step too: torch
    reads them from the groups at each step, so one set in ``param_groups`` during training
    (``group["maximize"] = True``) would otherwise be ignored without a word. Not ``capturable``
    while torch.compile traces the step: dynamo's view of an optimizer's ``param_groups`` reads
    ``capturable=True`` in every group (for torch's own optimizers), whatever the group holds, and
    the refusal of a flag the caller never set broke the trace there (``fullgraph=True`` failed
    with it)."""
    for key in TORCH_ONLY:
        if key == "capturable" and torch.compiler.is_compiling():
            continue
        if g.get(key):
            raise ValueError(f"Invalid {key}: {g[key]!r}; Fira does not implement torch.optim.AdamW's "
                             f"{key}=True (leave it unset or False)")
    if g.get("decoupled_weight_decay", True) is not True:
        raise ValueError(f"Invalid decoupled_weight_decay: {g['decoupled_weight_decay']!r}; Fira's weight decay "
                         "is decoupled, as torch.optim.AdamW's (leave it unset or True)")


def _python_real(value: Any) -> Any:
    """A real number of another type than Python's (a NumPy scalar: pickled as a NumPy object)
    as a Python float; an ``int``, a ``float`` or a tensor as it is."""
    if type(value) in (int, float) or isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        return value
    return float(value)


def _check_real(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is a real number (a string from a config file,
    None or a tensor of several elements failed later with a TypeError that named nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()):
        raise ValueError(f"Invalid {name}: {value!r}; expected a number")


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'X'?)`` for the choice closest to a misspelt ``word``, or ``""``."""
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def caller_level() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside fira_optim and torch's optimizer
    machinery (the user's constructor, ``add_param_group`` or ``load_state_dict`` call, that one
    also through torch's distributed ``set_optimizer_state_dict``), from the function calling this one."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("fira_optim.", "torch.optim.", "torch._dynamo.", "torch._compile",  # load_state_dict: dynamo's disable
             "torch.distributed.checkpoint.", "torch.utils._contextlib")):
        frame, level = frame.f_back, level + 1
    return level


def misspelt_option(key: Any, options) -> str | None:
    """The option among ``options`` that a group's unknown ``key`` is a slip of the keyboard away
    from (one edit, a swap of two neighbours included; two from six characters on), or None.
    Close, not merely similar: torch keeps a group's unknown keys for whoever reads them (a
    scheduler's ``initial_lr``, a framework's ``lr_scale`` or ``name``), and those must not be
    taken for misspellings."""
    if not isinstance(key, str) or len(key) < 4 or key in options:
        return None
    most = 1 if len(key) < 6 else 2
    close = [(_edits(key, option), option) for option in options if abs(len(option) - len(key)) <= most]
    best = min(close, default=None)
    return best[1] if best is not None and best[0] <= most else None


def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that turn ``a`` into ``b``
    (the optimal string alignment distance)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def param_name(gi: int, pi: int, p: torch.Tensor, group: dict | None = None, shape: bool = True) -> str:
    """How errors and warnings name a parameter: by its place, and first by its name where the
    optimizer was given names (``model.named_parameters()``: torch keeps them in the group's
    ``param_names``); with its shape unless ``shape=False``."""
    where = f"param_groups[{gi}]['params'][{pi}]"
    names = None if group is None else group.get("param_names")
    shown = f", shape {tuple(p.shape)}" if shape else ""
    if names and pi < len(names):
        return f"{names[pi]} ({where}{shown})"
    return f"{where} (shape {tuple(p.shape)})" if shape else where


def check_process_options(nonfinite: Any, implementation: Any, host_refresh: Any,
                          split_refresh: Any = False) -> None:
    """The constructor-only options (they are not per group)."""
    NonFinite.parse("nonfinite", nonfinite)
    Implementation.parse("implementation", implementation)
    if not isinstance(host_refresh, bool):
        raise ValueError(f"Invalid host_refresh: {host_refresh!r}; expected True or False")
    if not isinstance(split_refresh, bool):
        raise ValueError(f"Invalid split_refresh: {split_refresh!r}; expected True or False")


def check_options(**options: Any) -> None:
    """Validate :class:`fira_optim.FiraAdamW` keyword options by the constructor's own rules
    (``ValueError`` naming the argument and the value), before any parameter exists: for
    configs that hold the options of an optimizer built later."""
    values = {**_constructor_defaults(), **options}
    check_process_options(values["nonfinite"], values["implementation"], values["host_refresh"],
                          values["split_refresh"])
    if values["rank"] is not None:
        check_rank(values["rank"])
    validate_group({k: v for k, v in values.items() if k not in CONSTRUCTOR_ONLY})


@functools.lru_cache(maxsize=1)
def _constructor_defaults() -> dict[str, Any]:
    from .optimizer import Fira  # the constructor's signature holds the defaults

    return {name: p.default for name, p in inspect.signature(Fira.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}
