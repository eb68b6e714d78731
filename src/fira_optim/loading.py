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

Warned of: a group saved with another algorithm (``residual``, ``scaling``, ``limiter``,
``arithmetic``, ``only_scaling``, ``projector``) than the group it loads into. Loading restores
every group option, as torch's optimizers do, so the run goes on as it was saved; a user who
built a GaLore optimizer to resume a Fira checkpoint got Fira without a word.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import precision
from .options import TORCH_ONLY, caller_level, param_name
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
    for gi, (group, old) in enumerate(zip(current_groups, saved_groups)):
        if not group["params"]:
            continue
        first = param_name(gi, 0, group["params"][0], group)
        projected = group["rank"] is not None
        if projected and "rank" not in old:
            raise ValueError(
                f"{first}: the state dict's param group {gi} has no 'rank': it was not saved by "
                "Fira (torch.optim.AdamW's state has this layout) and would silently train every "
                "matrix of the group with plain AdamW. Start Fira from the model's weights "
                "without this optimizer state instead"
            )
        for key in LAYOUT_KEYS if projected else UNPROJECTED_LAYOUT_KEYS:
            was = old.get(key, SAVED_BEFORE_THE_KEY.get(key))
            if was is not None and was != group[key]:
                when = "" if key in old else f" (its group has no {key!r}: saved before the option existed)"
                raise ValueError(
                    f"{first}: the state dict was saved with {key}={was!r}{when} but this "
                    f"optimizer's group {gi} has {key}={group[key]!r}; build the optimizer with "
                    f"{key}={was!r} to resume it"
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


#: Group options that choose the algorithm (a variant), without changing the states' layout.
ALGORITHM_KEYS = ("residual", "scaling", "limiter", "arithmetic", "only_scaling", "projector")


def warn_replaced_algorithm(current_groups: list[dict], saved: dict[str, Any]) -> None:
    """A UserWarning for each group whose saved algorithm (:data:`ALGORITHM_KEYS`) differs from
    the one it loads into: the saved options replace the group's."""
    for gi, (group, old) in enumerate(zip(current_groups, saved.get("param_groups", []))):
        changed = [key for key in ALGORITHM_KEYS if key in old and key in group and old[key] != group[key]]
        if group["params"] and changed:
            saved_values = ", ".join(f"{key}={old[key]!r}" for key in changed)
            built = ", ".join(f"{key}={group[key]!r}" for key in changed)
            first = param_name(gi, 0, group["params"][0], group)
            warnings.warn(f"{first}: the state dict's param group {gi} was saved with {saved_values}, which it "
                          f"loads in place of this optimizer's {built}: loading restores every group option, as "
                          "torch's optimizers do, so the run goes on as it was saved", UserWarning,
                          stacklevel=caller_level())


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
