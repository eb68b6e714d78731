"""What :meth:`fira_optim.Fira.load_state_dict` accepts besides its own state dicts, and what it
refuses before anything is loaded.

Accepted and converted: step counters saved as plain numbers (older torch, many trainers), and
the state of the released ``fira`` package (its ``GradientProjector`` objects become ``basis``
tensors, its ``scaling_grad`` the limiter's ``prev_norm``), so a run of ``fira.FiraAdamW``
continues under :class:`fira_optim.FiraAdamW`; and ``galore-torch``'s (the same projector
objects, and its group key ``scale`` read as ``alpha``), so a run of ``galore_torch.GaLoreAdamW``
continues under :class:`fira_optim.GaLoreAdamW`.

Refused, with the reason: a state dict of another number of groups, or of parameters in a group
(torch's own messages say neither why nor what to do); one whose projected groups were saved at another rank or
projection rule or with another base optimizer (its tensors would not fit), one whose groups,
projected or not, were saved with another ``state_dtype`` (their states are stored otherwise;
loading took the saved dtype for the unprojected groups, whatever the optimizer was built with),
and one not saved by Fira at all (``torch.optim.AdamW``'s has the same layout, and loading it
would silently train every matrix with plain AdamW). A group saved without ``state_dtype``
(fira-optim before the option, the released ``fira`` package, ``galore-torch``) holds float32
states and is compared as ``state_dtype='float32'`` (loading it into an int8 optimizer kept its
float32 moments under an int8 group, silently). Refused too: a group that turned on an option of
``torch.optim.AdamW`` that Fira does not implement, and ``torch.optim.Adam``'s with weight decay
(``decoupled_weight_decay=False``: an L2 term of the gradient, which Fira's decoupled decay
replaced silently).

Refused too, naming the parameter, the key and the value (:func:`check_structure`,
:func:`check_values`, :func:`check_group_options`): a damaged or crafted state dict (a checkpoint
from elsewhere), which loaded without a word and then trained NaN, on a fresh state or with
options the constructor refuses, or failed inside torch with an error naming nothing. That is a
``state`` that is not a dict of dicts, a state keyed by an id no group lists (torch drops it, and
its parameter starts again from zeros), an id listed twice; a second moment (a sum of squares), a
norm or a scale with a negative entry, a tensor on the meta device, a complex one for a real
parameter (torch drops its imaginary part), a value that is not a tensor where the optimizer
keeps one; a ``step`` that is not one whole number >= 0; a group option out of the range the
constructor accepts (``lr=nan``, ``update_proj_gap=0``).

Warned of: a group saved with another algorithm (``residual``, ``scaling``, ``limiter``,
``arithmetic``, ``only_scaling``, ``projector``) than the group it loads into. Loading restores
every group option, as torch's optimizers do, so the run goes on as it was saved; a user who
built a GaLore optimizer to resume a Fira checkpoint got Fira without a word. Warned of too: the
released ``fira`` package's state loaded with ``arithmetic="paper"`` (its groups hold no
``arithmetic``, so the run goes on with Algorithm 1's steps, not the package's). Warned of, and
loaded: state tensors with NaN or Inf entries, which a step can leave (a finite gradient above
about 1.8e19 of a parameter that is not projected overflows its second moment, as in
``torch.optim.AdamW``; ``nonfinite="ignore"``), so that such a run can still be resumed.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Hashable
from typing import Any

import torch

from . import distributed, precision
from .options import (FLOAT32_MAX, TORCH_ONLY, Arithmetic, Base, ProjType, StateDtype, caller_level, check_rank,
                      param_name, validate_group)
from .projection import LEFT, projection_side

#: Group options that fix the layout of a projected matrix's state.
LAYOUT_KEYS = ("rank", "proj_type", "base", "state_dtype")
#: Those that fix the layout of an unprojected parameter's state.
UNPROJECTED_LAYOUT_KEYS = ("state_dtype",)
#: What a group saved before a layout key existed was built with (every state was float32).
SAVED_BEFORE_THE_KEY = {"state_dtype": "float32"}


def check_layout(current_groups: list[dict], saved: dict[str, Any]) -> None:
    """Refuse ``saved`` if its groups are not this optimizer's (their number, or a group's number
    of parameters: torch's own message names neither, nor what to do), if a group that this
    optimizer projects was saved without Fira's keys or with another layout, or an unprojected
    group with another ``state_dtype``."""
    saved_groups = saved.get("param_groups", [])
    fira = any("rank" in old for old in saved_groups)
    source = ("" if fira else " (its groups have no 'rank': it was not saved by Fira; torch.optim.AdamW's, say, "
              "which Fira cannot continue: start Fira from the model's weights without it)")
    how = ("; build the optimizer with the groups of the saved run (the same parameters and param_groups / "
           "optim_target_modules arguments, in the same order)")
    if len(saved_groups) != len(current_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups and this optimizer "
                         f"{len(current_groups)}{source or how}")
    for gi, (group, old) in enumerate(zip(current_groups, saved_groups)):
        if len(old.get("params", [])) != len(group["params"]):
            raise ValueError(f"the state dict's param group {gi} holds {len(old.get('params', []))} parameters and "
                             f"this optimizer's {len(group['params'])}{source or how}")
    # first, over every group: a state torch.optim.AdamW saved was told to rebuild its unprojected
    # group with state_dtype='float32', and only then that it cannot be loaded at all
    for gi, (group, old) in enumerate(zip(current_groups, saved_groups)):
        if group["params"] and group["rank"] is not None and "rank" not in old:
            raise ValueError(
                f"{param_name(gi, 0, group['params'][0], group)}: the state dict's param group {gi} has no "
                "'rank': it was not saved by Fira (torch.optim.AdamW's state has this layout) and would silently "
                "train every matrix of the group with plain AdamW. Start Fira from the model's weights without "
                "this optimizer state instead"
            )
    for gi, (group, old) in enumerate(zip(current_groups, saved_groups)):
        if not group["params"]:
            continue
        first = param_name(gi, 0, group["params"][0], group)
        projected = group["rank"] is not None
        for key in LAYOUT_KEYS if projected else UNPROJECTED_LAYOUT_KEYS:
            was = old.get(key, SAVED_BEFORE_THE_KEY.get(key))
            if was is not None and was != group[key]:
                # a value no optimizer takes is not one to build with. The value alone: the saved
                # group's other options (an earlier version's, the released package's, torch's
                # decoupled_weight_decay=False) are the load's to fill in or refuse, and this
                # group's state_rounding is not the saved state's
                _check_layout_value(gi, key, was)
                # torch.optim's groups lack it too: not only fira-optim's own before the option
                when = "" if key in old else (f" (its group has no {key!r}: saved by an optimizer without that "
                                              "option: torch.optim's, the released fira's, galore-torch's, or "
                                              "fira-optim's before it)")
                raise ValueError(
                    f"{first}: the state dict was saved with {key}={was!r}{when} but this "
                    f"optimizer's group {gi} has {key}={group[key]!r}; build the optimizer with "
                    f"{key}={was!r}{_rounding_too(key, was, group)} to resume it"
                )
        # the loaded group's options replace this one's: one Fira does not implement would be
        # dropped without a word (a maximize=True run turned into descent)
        for key in TORCH_ONLY:
            if old.get(key):
                raise ValueError(f"{first}: the state dict's param group {gi} has {key}={old[key]!r}, which Fira "
                                 f"does not implement (torch.optim.AdamW's {key}); it cannot be resumed as it ran")
        # torch.optim.Adam's groups say decoupled_weight_decay=False: its weight decay is an L2 term
        # added to the gradient, which Fira (decoupled, as torch.optim.AdamW) would have replaced
        # without a word. Without weight decay the two are the same step (see _filled).
        if old.get("decoupled_weight_decay", True) is False and old.get("weight_decay", 0) != 0:
            raise ValueError(f"{first}: the state dict's param group {gi} has decoupled_weight_decay=False with "
                             f"weight_decay={old['weight_decay']!r} (torch.optim.Adam's L2 weight decay); Fira's "
                             "weight decay is decoupled, as torch.optim.AdamW's: it cannot be resumed as it ran")


#: The constructor's check of each layout option's value alone.
_LAYOUT_VALUE_CHECKS = {"rank": check_rank, "state_dtype": lambda value: StateDtype.parse("state_dtype", value),
                        "proj_type": lambda value: ProjType.parse("proj_type", value),
                        "base": lambda value: Base.parse("base", value)}


def _check_layout_value(gi: int, key: str, was: Any) -> None:
    """ValueError where the saved group ``gi``'s layout option ``key`` is ``was``, a value no
    optimizer takes (``state_dtype='int4'``, ``rank=-3``): not one to build the optimizer with."""
    try:
        _LAYOUT_VALUE_CHECKS[key](was)
    except (ValueError, TypeError) as err:
        raise _invalid_group(gi, err) from None


def _invalid_group(gi: int, err: Exception) -> ValueError:
    """The error for the state dict's group ``gi`` holding an option value ``err`` refuses."""
    return ValueError(f"the state dict's param group {gi}: {err}; loading restores every group option, so the "
                      "optimizer would train with it")


def _rounding_too(key: str, was: Any, group: dict) -> str:
    """What else building with ``key=was`` takes: stochastic state_rounding is of bf16 states only."""
    if key != "state_dtype" or was == StateDtype.BFLOAT16.value or group.get("state_rounding") != "stochastic":
        return ""
    return " and state_rounding='nearest' (stochastic rounding is of bf16 states)"


def check_structure(saved: Any) -> None:
    """Refuse ``saved`` unless it is laid out as an optimizer's state dict: ``param_groups`` a list
    of dicts whose ``params`` list each id once, ``state`` a dict of dicts keyed by those ids.
    torch drops a state keyed by an id no group lists (a state dict whose ids were renumbered, or
    edited), and its parameter trained on from a fresh state without a word; the other
    departures failed inside torch (``AttributeError``, ``KeyError: 'step'``) naming nothing."""
    if not isinstance(saved, dict):
        raise ValueError(f"the state dict is {_shown(saved)}, not a dict (an optimizer's state_dict())")
    groups, state = saved.get("param_groups"), saved.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise ValueError(f"the state dict's 'param_groups' is {_shown(groups)}, not a list of dicts: it was not "
                         "saved by an optimizer's state_dict()")
    if not isinstance(state, dict):
        raise ValueError(f"the state dict's 'state' is {_shown(state)}, not a dict of each parameter's state: it was "
                         "not saved by an optimizer's state_dict()")
    listed: dict[Any, int] = {}
    for gi, group in enumerate(groups):
        ids = group.get("params", [])
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"the state dict's param group {gi} has params={_shown(ids)}, not a list of parameter ids")
        for pid in ids:
            if not isinstance(pid, Hashable) or isinstance(pid, float):
                raise ValueError(f"the state dict's param group {gi} lists {_shown(pid)} as a parameter id")
            if pid in listed:
                raise ValueError(f"the state dict lists parameter id {pid!r} twice (in param group {listed[pid]} "
                                 f"and param group {gi}): torch would give two parameters one state")
            listed[pid] = gi
    for pid, entry in state.items():
        if pid not in listed:
            raise ValueError(f"the state dict holds a state for parameter id {pid!r}, which none of its param groups "
                             "lists: torch would drop it, and its parameter start again from a fresh state (a state "
                             "dict whose ids were renumbered or edited)")
        if not isinstance(entry, dict):
            raise ValueError(f"the state dict's state of parameter id {pid!r} is {_shown(entry)}, not a dict of its "
                             "tensors")


#: The states that are never negative: sums of squares (:data:`fira_optim.precision.ROOT`), the
#: limiter's previous norm, and the int8 codes' scales (``*_scale``).
NON_NEGATIVE = frozenset(precision.ROOT | {"prev_norm"})
#: Every state key the optimizer keeps as a tensor (and the int8 codes' ``*_scale``).
TENSOR_KEYS = frozenset(set(precision.SIGNED) | {"step", "basis", "prev_norm"})


def check_values(current_groups: list[dict], saved: dict[str, Any]) -> None:
    """Refuse a state whose values no optimizer step leaves (see the module docstring), naming
    the parameter (as it is in this optimizer), the key and the value. ``saved`` has passed
    :func:`check_structure` and :func:`check_layout`: its groups pair with these."""
    state = saved.get("state", {})
    nonfinite: list[str] = []
    for gi, (group, old) in enumerate(zip(current_groups, saved["param_groups"])):
        for pi, (p, pid) in enumerate(zip(group["params"], old.get("params", []))):
            for key, value in state.get(pid, {}).items():
                if key == "step":
                    problem = _step_problem(value)
                elif key in TENSOR_KEYS or (isinstance(key, str) and key.endswith("_scale")):
                    problem = _tensor_problem(p, key, value)
                else:
                    continue
                if problem == NONFINITE:
                    nonfinite.append(f"{key!r} of {param_name(gi, pi, p, group)}")
                elif problem:
                    raise ValueError(f"the state dict's {key!r} of {param_name(gi, pi, p, group)} {problem}: "
                                     "the state is damaged, or was not saved by an optimizer step; nothing was loaded")
    if nonfinite:
        # A step can leave them: a finite gradient above ~1.8e19 of a parameter that is not
        # projected overflows its second moment to Inf (torch.optim.AdamW's too), and
        # nonfinite="ignore" lets NaN through. Refused, such a run could not be resumed at all;
        # loaded, it goes on as it would have.
        more = f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else ""
        warnings.warn(f"the state dict holds NaN or Inf in {', '.join(nonfinite[:3])}{more}: loaded as saved, so "
                      "the run goes on as it would have (those entries' updates are NaN or zero); a damaged "
                      "checkpoint, or one an overflowing step left", UserWarning, stacklevel=caller_level())


def _step_problem(value: Any) -> str | None:
    """Why ``value`` is not a step counter (one whole number >= 0), or None."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return "is on the meta device (it holds no value)"
        if value.numel() != 1:
            return f"is a tensor of {value.numel()} elements, where a step counter is one number"
        if value.is_complex() or value.dtype == torch.bool:
            return f"is {value.dtype}, where a step counter is a number"
        number = float(distributed.to_local(value).detach().reshape(()).cpu())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
    else:
        return f"is {_shown(value)}, where a step counter is a number"
    if not (math.isfinite(number) and 0 <= number <= FLOAT32_MAX and number == math.floor(number)):
        shown = f"{number!r} (a tensor)" if isinstance(value, torch.Tensor) else _shown(value)
        return f"is {shown}, where a step counter is a whole number >= 0"
    return None


#: What :func:`_tensor_problem` says of a state tensor whose only fault is NaN or Inf entries:
#: warned of, and loaded (:func:`check_values`).
NONFINITE = "holds NaN or Inf"


def _tensor_problem(p: torch.Tensor, key: str, value: Any) -> str | None:
    """Why ``value`` is not a state tensor of ``p`` under ``key`` (:data:`NONFINITE` where NaN or
    Inf entries are all that is wrong), or None (its shape and dtype against the group are
    :func:`fira_optim.optimizer._check_state`'s, once loaded)."""
    if not isinstance(value, torch.Tensor):
        return f"is {_shown(value)}, not a tensor"
    local = distributed.to_local(value).detach()  # a DTensor: this rank's block
    if local.is_meta:
        return "is on the meta device: it holds no values (an optimizer built on 'meta' parameters)"
    if local.is_complex() and not p.is_complex():
        return f"is {local.dtype}, and the parameter {p.dtype}: loading would drop its imaginary part"
    if not (local.is_floating_point() or local.is_complex()):
        return None  # int8 codes: every value is one
    flat = local.reshape(-1)
    if flat.numel() == 0:
        return None
    # one reduction pass, no temporary: the extremes are NaN where any entry is (aminmax propagates
    # it), +-Inf where any entry is, and the smallest is the one a sign check needs; elementwise
    # isfinite / < 0 masks each made a bool tensor of the state's size. One host sync a tensor.
    low, high = torch.aminmax(torch.view_as_real(flat) if flat.is_complex() else flat)
    negative = (key in NON_NEGATIVE or key.endswith("_scale")) and not flat.is_complex()
    good = torch.isfinite(low) & torch.isfinite(high)
    if bool(good & (low >= 0)) if negative else bool(good):
        return None
    below = flat[flat < 0] if negative else flat[:0]  # -Inf too; NaN is not below 0
    if below.numel():
        what = "a sum of squares" if key in precision.ROOT else "a norm" if key == "prev_norm" else "a scale"
        return f"holds negative entries (the smallest {float(below.min()):g}), where {what} is never negative"
    return NONFINITE


def check_group_options(saved: dict[str, Any]) -> None:
    """Refuse a saved group (as :func:`upgraded` fills it) whose options the constructor refuses
    (:func:`fira_optim.options.validate_group`): loading restores every group option, so the
    optimizer went on with ``lr=nan`` or ``betas=(1.5, 0.999)``, or failed at its first step
    (``update_proj_gap=0``: ZeroDivisionError)."""
    for gi, group in enumerate(saved.get("param_groups", [])):
        try:
            validate_group(dict(group))  # a copy: it writes the ints it normalizes
            if group.get("rank") is not None:  # the constructor's check (None: a group not projected)
                check_rank(group["rank"])
        except (ValueError, KeyError) as err:
            raise _invalid_group(gi, err) from None


def _shown(value: Any) -> str:
    """``value`` for a message: a tensor by its shape and dtype, else its repr (cut short)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} ({value.device})"
    text = repr(value)
    return f"{text[:60]}... (a {type(value).__name__})" if len(text) > 60 else f"{text} (a {type(value).__name__})"


#: Group options that choose the algorithm (a variant), without changing the states' layout.
ALGORITHM_KEYS = ("residual", "scaling", "limiter", "arithmetic", "only_scaling", "projector")
#: Those that choose how bf16 weights and states are rounded: a run resumed with stochastic
#: rounding turned on went on rounding to nearest, as saved, without a word.
ROUNDING_KEYS = ("state_rounding", "stochastic_rounding")


def warn_replaced_algorithm(current_groups: list[dict], saved: dict[str, Any]) -> None:
    """A UserWarning for each group whose saved algorithm (:data:`ALGORITHM_KEYS`) or rounding
    (:data:`ROUNDING_KEYS`) differs from the one it loads into: the saved options replace the
    group's."""
    for gi, (group, old) in enumerate(zip(current_groups, saved.get("param_groups", []))):
        changed = [key for key in ALGORITHM_KEYS + ROUNDING_KEYS
                   if key in old and key in group and old[key] != group[key]]
        if group["params"] and changed:
            saved_values = ", ".join(f"{key}={old[key]!r}" for key in changed)
            built = ", ".join(f"{key}={group[key]!r}" for key in changed)
            first = param_name(gi, 0, group["params"][0], group)
            warnings.warn(f"{first}: the state dict's param group {gi} was saved with {saved_values}, which it "
                          f"loads in place of this optimizer's {built}: loading restores every group option, as "
                          "torch's optimizers do, so the run goes on as it was saved", UserWarning,
                          stacklevel=caller_level())


def warn_released_arithmetic(current_groups: list[dict], saved: dict[str, Any]) -> None:
    """A UserWarning for each projected group that loads the state of the released ``fira``
    package (``fira.FiraAdamW``: its matrices' states hold a projector object and the limiter's
    ``scaling_grad``) with ``arithmetic="paper"``. The package's groups hold no ``arithmetic``, so
    the group's own applies (:func:`_filled`): the run went on with Algorithm 1's steps, whose
    residual is scaled by ``alpha`` where the package's is not (a quarter of it at the paper's
    ``alpha=0.25``), without a word."""
    state = saved.get("state", {})
    for gi, (group, old) in enumerate(zip(current_groups, saved.get("param_groups", []))):
        if (not group["params"] or group["rank"] is None or "arithmetic" in old
                or Arithmetic(group["arithmetic"]) is not Arithmetic.PAPER):
            continue
        entries = [state.get(pid) for pid in old.get("params", [])]
        if any(isinstance(e, dict) and "projector" in e and "scaling_grad" in e for e in entries):
            first = param_name(gi, 0, group["params"][0], group)
            warnings.warn(f"{first}: the state dict's param group {gi} was saved by the released fira package "
                          "(fira.FiraAdamW), whose steps are arithmetic='released'; it loads into this optimizer's "
                          "arithmetic='paper' and goes on with Algorithm 1's steps (the residual scaled by alpha, "
                          "where the package's is not). To continue the run as it ran, build the optimizer with "
                          "arithmetic='released'", UserWarning, stacklevel=caller_level())


def upgraded(saved: dict[str, Any], current_groups: list[dict]) -> dict[str, Any]:
    """``saved`` with plain-number steps as tensors, the released package's per-matrix state in
    this optimizer's form, galore-torch's group key ``scale`` as ``alpha`` (the optimizer's
    default ``alpha`` would replace it otherwise), the options a saved group lacks (the released
    packages', an earlier version's) at the values of the group it loads into, and
    ``decoupled_weight_decay`` True (:func:`_filled`), and int8 second moments of earlier versions
    coded as square roots (:func:`fira_optim.precision.root_coded`); ``saved`` itself is not
    modified."""
    groups = saved.get("param_groups", [])
    # group counts that differ are left to torch's own check
    currents = [*current_groups, *[{}] * (len(groups) - len(current_groups))]
    if any(("scale" in g and "alpha" not in g) or not _options(current).keys() <= g.keys()
           or not SAVED_BEFORE_THE_KEY.keys() <= g.keys() or g.get("decoupled_weight_decay", True) is not True
           for g, current in zip(groups, currents)):
        saved = {**saved, "param_groups": [_filled(g, current) for g, current in zip(groups, currents)]}
    state = saved.get("state", {})
    if not any(_needs_upgrade(s) for s in state.values()):
        return saved
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    params = [p for g in current_groups for p in g["params"]]
    param_of = dict(zip(ids, params))
    new_state = {}
    for key, entry in state.items():
        entry = dict(entry)
        if "step" in entry and not isinstance(entry["step"], torch.Tensor):
            entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
        if "projector" in entry:
            entry = _from_released(entry, param_of.get(key))
        new_state[key] = precision.root_coded(entry)
    return {**saved, "state": new_state}


def _options(group: dict) -> dict:
    """A param group's options: all but its tensors and their names."""
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


def _filled(group: dict, current: dict) -> dict:
    """A saved group with galore-torch's ``scale`` as ``alpha``, the keys it was saved before
    (:data:`SAVED_BEFORE_THE_KEY`) at the values its states have, and every other option it
    lacks at the value of ``current``, the group it loads into. torch's load takes the saved
    group, and the optimizer would fill a missing key from its constructor's default: an int8
    default put float32 states under an int8 group that :func:`check_layout` had compared as
    float32, and the options a group sets itself that the saving package does not know (the
    released ``fira``'s and galore-torch's groups have no ``arithmetic``, ``gamma``, ...: what
    ``param_groups(model, arithmetic="released")`` sets on the projected group) fell back to
    the constructor's, so a migrated run went on with Algorithm 1's arithmetic, silently.
    ``decoupled_weight_decay`` is set True: the weight decay Fira applies (torch.optim.Adam's
    groups, with ``False``, load only without weight decay: :func:`check_layout`)."""
    renamed = {"alpha": group["scale"]} if "scale" in group and "alpha" not in group else {}
    if "decoupled_weight_decay" in group:
        renamed["decoupled_weight_decay"] = True
    before = {key: value for key, value in SAVED_BEFORE_THE_KEY.items() if key not in group}
    return {**_options(current), **before, **group, **renamed}


def _needs_upgrade(entry: dict) -> bool:
    return ("projector" in entry or ("step" in entry and not isinstance(entry["step"], torch.Tensor))
            or bool(precision.value_coded(entry)))


def _from_released(entry: dict, param: torch.Tensor | None) -> dict:
    """One matrix of ``fira.FiraAdamW``: its projector's ``ortho_matrix`` is ``P`` (left,
    ``m x r``) or ``Q^T`` (right, ``r x n``) by the same side rule as ours."""
    projector = entry.pop("projector")
    ortho = getattr(projector, "ortho_matrix", None)
    proj_type = getattr(projector, "proj_type", None)
    if param is None or not isinstance(ortho, torch.Tensor) or proj_type not in (
            "std", "reverse_std", "left", "right"):
        raise ValueError("the released fira state has a projector this optimizer cannot read "
                         f"(proj_type={proj_type!r}); only 'std', 'reverse_std', 'left' and "
                         "'right' projections carry over")
    side = projection_side(tuple(param.shape), proj_type)
    basis = ortho if side == LEFT else ortho.T
    entry["basis"] = basis.to(torch.promote_types(param.dtype, torch.float32)).contiguous()
    if "scaling_grad" in entry:
        norm = entry.pop("scaling_grad")
        entry["prev_norm"] = torch.as_tensor(norm, dtype=entry["basis"].dtype).reshape(())
    return entry
