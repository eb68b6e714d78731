"""Building param groups: which weights are projected.

:func:`param_groups` is the recommended helper; :func:`divide_params` reproduces the released
``fira.divide_params`` (same groups, same meaning, but where torch refuses the released one's)
for drop-in use.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .distributed import reject_fsdp1
from .options import did_you_mean


def divide_params(
    model: nn.Module,
    target_modules_list: Iterable[str] = (),
    rank: int = 8,
    update_proj_gap: int = 200,
    alpha: float = 1.0,
    proj_type: str = "std",
) -> list[dict[str, Any]]:
    """The released helper: project the weight of every ``nn.Linear`` whose module name contains
    one of ``target_modules_list``; everything else goes to an unprojected group. Unlike the
    released one, a weight computed from parameters (``weight_norm``, ``spectral_norm``, any
    ``torch.nn.utils.parametrize`` parametrization) is not projected, as :func:`param_groups`
    leaves it (the parameters it is computed from go to the unprojected group; the released
    helper put the computed tensor in the projected group, which torch refuses: "can't optimize
    a non-leaf Tensor"), and a weight shared by several matched layers is listed once. A
    ``model`` that is not an ``nn.Module`` is a TypeError naming it (the released helper returned
    None for ``model=None``, which the optimizer then refused as "not iterable")."""
    if not isinstance(model, nn.Module):
        got = "model=None" if model is None else f"model of type {type(model).__name__}"
        raise TypeError(f"divide_params() takes the model (an nn.Module), got {got}; a list of tensors "
                        "goes to FiraAdamW directly, which projects its 2-D ones")
    reject_fsdp1(model)  # FSDP1 flattens the weights: nothing would be projected, silently
    targets = list(target_modules_list)
    projected = _unique(
        module.weight
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(key in name for key in targets) and _leaf_weight(module)
    )
    chosen = {id(p) for p in projected}
    regular = [p for p in model.parameters() if id(p) not in chosen]
    return [
        {"params": regular},
        {"params": projected, "rank": rank, "update_proj_gap": update_proj_gap,
         "alpha": alpha, "proj_type": proj_type},
    ]


def _compiled(argument: str, patterns: Iterable[str] | str | None) -> list[re.Pattern] | None:
    """``include`` / ``exclude`` as compiled regular expressions (None: not given), checked once,
    before any module is looked at; a bad one is a ValueError naming the argument. Read once:
    a generator of patterns serves every module, not the first alone."""
    if patterns is None:
        return None
    compiled = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"param_groups(): {argument}={pattern!r} is not a regular expression: {err}") from None
    return compiled


def _matches(name: str, patterns: list[re.Pattern] | None) -> bool:
    return patterns is not None and any(p.search(name) for p in patterns)


def _excluded_by_role(model: nn.Module) -> set[int]:
    """Ids of weights that are never projected: embeddings and the output head. A parametrized
    weight is not read (reading computes it: spectral_norm's power iteration moves its state); it
    is never projected anyway (:func:`param_groups` leaves it out)."""
    def weight_of(module: nn.Module | None) -> Any:
        if module is None or parametrize.is_parametrized(module, "weight"):
            return None
        return getattr(module, "weight", None)

    ids = {id(weight) for m in model.modules() if isinstance(m, nn.Embedding) and (weight := weight_of(m)) is not None}
    for getter in ("get_output_embeddings", "get_input_embeddings"):
        fn = getattr(model, getter, None)
        weight = weight_of(fn() if callable(fn) else None)
        if weight is not None:
            ids.add(id(weight))
    return ids


def param_groups(
    model: nn.Module,
    rank: int = 128,
    update_proj_gap: int = 200,
    alpha: float = 0.25,
    *,
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    **group_options: Any,
) -> list[dict[str, Any]]:
    r"""Param groups for :class:`fira_optim.FiraAdamW`.

    Projects the real 2-D weights of ``nn.Linear`` layers (and of Hugging Face's ``Conv1D``,
    GPT-2's linear layers: attention and MLP matrices), never
    embeddings or the output head (``get_output_embeddings()`` and any weight tied to an
    embedding), nor 1-D tensors, nor a weight computed from parameters (``weight_norm``,
    ``spectral_norm``, any ``torch.nn.utils.parametrize`` parametrization: the parameters it is
    computed from go to the plain group). ``include`` / ``exclude`` are regular expressions
    searched in the module name (``include`` restricts the projected set, ``exclude`` removes
    from it).
    Tied weights appear once. Parameters frozen at the call (``requires_grad=False``) are left
    out, as the Hugging Face Trainer leaves them out of its optimizer: one unfrozen later trains
    only once added (``optimizer.add_param_group``). ``group_options`` (e.g. ``proj_type``, ``gamma``, any variant
    setting) are set on the projected group. A model with 2-D weights none of which qualifies
    gets a ``UserWarning``: the optimizer would be plain AdamW.
    """
    _check_group_options(group_options)
    if not isinstance(model, nn.Module):  # e.g. model.parameters(): no modules to tell linear layers by
        raise TypeError(f"param_groups() takes the model (an nn.Module), got {type(model).__name__}; a "
                        "list of tensors goes to FiraAdamW directly, which projects its 2-D ones")
    include, exclude = _compiled("include", include), _compiled("exclude", exclude)
    reject_fsdp1(model)  # FSDP1 flattens the weights: nothing would be projected, silently
    never = _excluded_by_role(model)
    projected: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not _is_linear(module) or not _leaf_weight(module):
            continue
        weight = module.weight
        if weight.dim() != 2 or weight.is_complex():
            continue  # a complex weight steps as torch.optim.AdamW does, in the plain group
        if id(weight) in never or id(weight) in seen or not weight.requires_grad:
            continue
        if include is not None and not _matches(name, include):
            continue
        if _matches(name, exclude):
            continue
        seen.add(id(weight))
        projected.append(weight)
    regular = [p for p in _unique(model.parameters()) if id(p) not in seen and p.requires_grad]
    if not projected and any(p.dim() == 2 for p in regular):
        warnings.warn("param_groups(model): no weight of an nn.Linear (or transformers Conv1D) layer "
                      "qualified (include/exclude, frozen, parametrized, embeddings and head left out): "
                      "nothing is projected, and the optimizer is plain AdamW", UserWarning, stacklevel=2)
    groups: list[dict[str, Any]] = []
    if regular:
        groups.append({"params": regular, "rank": None})
    if projected:
        groups.append({"params": projected, "rank": rank, "update_proj_gap": update_proj_gap,
                       "alpha": alpha, **group_options})
    return groups


def _check_group_options(options: dict[str, Any]) -> None:
    """TypeError naming each of ``options`` that no param group of :class:`fira_optim.FiraAdamW`
    reads (with the closest that one does): torch's optimizers keep any key of a group, so
    ``param_groups(model, rnak=8)`` trained at the default rank without a word. The optimizer's
    own options (``implementation``, ...) are refused by the optimizer, naming the group."""
    import inspect

    from .optimizer import FiraAdamW  # it imports this module

    known = set(inspect.signature(FiraAdamW.__init__).parameters) - {"self", "params", "no_deprecation_warning"}
    known.add("scale")  # galore-torch's name for alpha (GaLoreAdamW)
    for key in options:
        if key not in known:
            raise TypeError(f"param_groups() got an unexpected option {key!r}{did_you_mean(key, known)}: "
                            "the options are FiraAdamW's (see its signature)")


def _leaf_weight(module: nn.Module) -> bool:
    """Whether ``module.weight`` is a parameter of its own, not one computed from parameters."""
    if parametrize.is_parametrized(module, "weight"):
        # computed from parameters at each access (spectral_norm's runs a power iteration,
        # which moves its state): never read here, its parameters are plain
        return False
    # not a Parameter: computed by a forward pre-hook (torch.nn.utils' older weight_norm and
    # spectral_norm), not a leaf, which the optimizer refuses; its parameters are plain
    return isinstance(getattr(module, "weight", None), nn.Parameter)


def _is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear``, or Hugging Face's ``Conv1D`` (GPT-2's attention and MLP layers: a linear
    layer whose weight is stored transposed, ``in x out``; matched by name, so that torch stays
    the only dependency)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out, seen = [], set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
