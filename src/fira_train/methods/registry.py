"""The method registry: one name -> one factory that builds the optimizer (and wraps the model).

Every training method of the paper's comparison and ablations is a :class:`Method` in
:data:`METHODS`, used identically by ``fira-train pretrain --method NAME`` and by ``compare``
(``fira-train finetune`` offers seven of them -- ``adamw``, ``lora``, ``galore``, ``fira``, ``apollo``,
``flora``, ``slimadam`` -- and two of its own: the view :data:`fira_train.finetune.config.METHODS`):

- ``adamw``: full-rank ``torch.optim.AdamW``;
- ``adamw-grouped``: full-rank AdamW with Fira's per-group step sizes (the matrices Fira projects
  at ``optim.alpha * lr``, embeddings, norms and head at ``lr``): the control that tells Fira's
  low-rank machinery from its learning rates;
- ``fira`` and every variant of :data:`fira_optim.VARIANTS` (``fira-matrix``, ``fira-no-scaling``,
  ``fira-no-limiter``, ``fira-clip``, ``fira-shrink``, ``fira-tensorwise``, ``fira-only-scaling``,
  ``fira-only-scaling-random``, ``fira-released``, ``galore``, ``galore-add``, ``fira-adagrad``,
  ``galore-adagrad``, ``fira-rmsprop``, ``galore-rmsprop``, ``frugal``):
  ``fira_optim.FiraAdamW(param_groups(model, rank, T, alpha), lr, **VARIANTS[name])`` -- the
  attention and MLP matrices are projected, embeddings, norms and the head get plain AdamW;
- ``lora``: ``peft`` LoRA adapters of rank r on every attention and MLP matrix; as in the
  pre-training baselines of GaLore and ReLoRA, embeddings, norms and the head train in full;
- ``relora``: ``lora`` whose adapters are merged into the weights and re-initialised every
  ``optim.relora_every`` steps, the adapters' Adam moments magnitude-pruned
  (``optim.relora_prune``, 0.99 as in the ReLoRA paper) and the learning rate re-warmed
  (a jagged cosine schedule). ReLoRA's initial full-rank warm start is not reproduced;
- ``sgd`` (momentum ``betas[0]``), ``adagrad``: ``torch.optim``;
- ``adam-mini``: the ``adam-mini`` package (``Adam_mini``), told the model's width and heads;
- ``apollo``, ``apollo-mini``: the authors' ``apollo-torch`` package (APOLLO: random projection
  at rank ``optim.rank``, channel-wise gradient scaling, scale 1; APOLLO-Mini: rank 1, tensor-wise
  scaling, scale 128; the projection redrawn every ``optim.update_proj_gap`` steps; Fira's
  norm-growth limiter; embeddings, norms and head get AdamW) -- :mod:`fira_train.methods.apollo`;
- ``flora``: the authors' ``flora-opt`` package (Adafactor whose momentum is compressed to
  rank ``optim.rank`` by a random projection resampled every ``optim.update_proj_gap`` steps,
  over every parameter; its gradient-accumulation compression is not used) --
  :mod:`fira_train.methods.flora`;
- ``slimadam``: SlimAdam, written here (AdamW whose second moment is averaged over the fan-in or
  fan-out per the SlimAdam paper's Table 1 rules) -- :mod:`fira_train.methods.slimadam`.

``apollo``, ``apollo-mini``, ``flora`` and ``slimadam`` refuse ``train.parallel=fsdp2``
(:attr:`Method.fsdp2`).

Where a baseline is not its reference's arithmetic, deliberately:

- ``eps``: every method takes ``optim.eps``, 1e-8 by default (``torch.optim.AdamW``'s), while
  ``fira`` 1.0.2, galore-torch 1.0 and apollo-torch 1.0.3 default to 1e-6, which their authors'
  pre-training scripts keep. Where ``sqrt(v)`` is small beside 1e-6 (small gradients, early
  steps) the two differ by more than round-off; ``optim.eps=1e-6`` reproduces theirs.
- ``galore`` is Algorithm 1's arithmetic with the residual dropped (fira_optim's default), not
  galore-torch's: the projected matrices take the same steps, but the unprojected parameters are
  ``torch.optim.AdamW`` (``eps`` after the bias correction) where galore-torch adds ``eps`` before
  it, and weight decay comes before the update instead of after (they differ where ``eps`` is
  not small beside ``sqrt(v)``: rarely seen rows of the head). ``fira-released`` is ``fira``
  1.0.2's arithmetic (``tests/fira_optim/test_parity_released.py``).
- ``adamw-grouped`` puts every attention / MLP matrix at ``alpha * lr``; a Fira run trains a
  matrix whose smaller side is at most ``optim.rank`` with plain Adam at ``lr`` (there is no
  residual to project), so at such ranks (``rank >= min(m, n)``, e.g. the k / v projections of a
  grouped-query model) the control's step on those matrices is ``alpha`` times Fira's. No recipe
  has such a matrix.
- ``apollo``, ``apollo-mini`` and ``flora`` are the authors' packages' arithmetic, which differs
  from the papers' bias-corrected Adam in places (:mod:`fira_train.methods.apollo`,
  :mod:`fira_train.methods.flora`); ``slimadam`` decays every parameter where the authors' code
  decays only tensors of two or more dimensions (:mod:`fira_train.methods.slimadam`).

Default learning rates (``optim.lr=None`` where the recipe has no tuned rate for the method,
:data:`fira_train.config.recipes.TUNED_LR`; ``tiny`` has one for Fira, GaLore, fira-released,
AdamW and adamw-grouped): 0.01 for every Fira/GaLore-family name (the paper
uses 0.01 for Fira and GaLore without tuning) and for ``adamw-grouped`` (Fira's, so that by
default it takes Fira's step sizes); 0.001 for ``adamw``, ``lora``, ``relora`` and
``adam-mini`` (a common AdamW default, not a tuned value: the paper tunes its baselines over
{0.01, 0.005, 0.001, 0.0005, 0.0001}; Adam-mini recommends reusing AdamW's; ``fira-train sweep``
tunes any of them);
0.01 for ``adagrad`` (``torch.optim.Adagrad``'s default, also the best of {0.03, 0.01, 0.003} on
``micro``); 0.03 for ``sgd`` (no paper value: the best of {1, 0.3, 0.1, 0.03, 0.01, 0.003} in a
60-step ``micro`` run on a synthetic corpus, 1 diverged; a smoke-level choice, tune it on real data).
The paper's other baselines carry their authors' values: 0.01 for ``apollo`` and ``apollo-mini``
(apollo-torch 1.0.3's README: the usage example ``APOLLO(param_groups, lr=0.01)``, and "keeping
the learning rate fixed at 1e-2" for both in its long-context benchmark; its scale 1 / 128 and
rank 1 for Mini are the README's "Hyperparameter choices"); 0.001 for ``slimadam`` (its README:
"Works with the same hyperparameters as Adam, no learning rate retuning needed", so AdamW's
0.001); 0.01 for ``flora``, whose Adafactor base scales the step by the parameter's RMS (so
the absolute step at LLaMA's 0.02 initialisation is ~0.02 x lr): Adafactor's relative step size
for pre-training (Shazeer & Stern 2018, min(1e-2, 1/sqrt(t)); T5 pre-trains with 0.01). The Flora
authors' only from-scratch run (T5-small, ``replicate.sh`` of github.com/BorealisAI/flora-opt)
reuses Adafactor's 1e-3 there; on ``micro`` (20 steps, one seed: ``docs/results/flora-micro/``)
1e-3 / 1e-2 / 3e-2 / 1e-1 / 0.3 / 1 reached validation perplexity 515 / 508 / 478 / 317 / 247 /
308 (lr 3 diverged; AdamW 247 at its best lr, 3e-3), so tune it before reading a comparison.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

import fira_optim
from fira_train.methods.lora import build_lora, build_relora
from fira_train.methods.method import Method, MethodSetup
from fira_train.methods.optimizers import (
    build_adagrad,
    build_adam_mini,
    build_adamw,
    build_adamw_grouped,
    build_apollo,
    build_apollo_mini,
    build_flora,
    build_sgd,
    build_slimadam,
    fira_family,
)

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from fira_train.config.run_config import RunConfig


def build_method(model: nn.Module, config: "RunConfig", *, split_refresh: bool = False) -> MethodSetup:
    """Build ``config.optim.method`` for ``model``.

    ``split_refresh=True`` (a DDP run) is passed on to the methods that accept it
    (:attr:`Method.split_refresh`) and ignored by the others. ``optim.lr`` None is the method's
    default; a run resolves it first, also to a recipe's tuned rate
    (:func:`fira_train.config.resolve.resolved`).
    """
    method = get_method(config.optim.method)
    lr = config.optim.lr if config.optim.lr is not None else method.default_lr
    if split_refresh and method.split_refresh:
        return method.build(model, config, lr, split_refresh=True)
    return method.build(model, config, lr)


def get_method(name: str) -> Method:
    """The registry entry ``name``; ValueError listing every valid name otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHODS)}")
    return METHODS[name]


FIRA_LR = 0.01
FLORA_LR = 0.01

#: The ``optim`` settings of Adam's update.
ADAM = frozenset({"betas", "eps", "weight_decay"})
#: What the Fira / GaLore family reads (:func:`fira_uses` takes away what a variant fixes or has no use for).
FIRA = ADAM | {"rank", "update_proj_gap", "alpha", "gamma", "projector", "implementation", "host_refresh",
               "step_in_backward", "state_dtype", "state_rounding", "stochastic_rounding", "align_signs"}
LORA = ADAM | {"rank", "lora_alpha", "lora_dropout"}


def fira_uses(options: dict) -> frozenset[str]:
    """The ``optim`` settings a Fira / GaLore variant with these FiraAdamW ``options`` reads.

    Its own projector wins over the config's (an ``align_signs`` it fixes is still read: the other
    value is refused); gamma belongs to the norm-growth limiter of the residual (no residual, or
    another limiter: unused); an Adagrad base has no moment decay rates.
    """
    uses = set(FIRA)
    if "projector" in options:
        uses.discard("projector")
    if options.get("limiter", "growth") != "growth" or options.get("residual", "add") == "drop":
        uses.discard("gamma")
    if options.get("base", "adam") == "adagrad":
        uses.discard("betas")
    return frozenset(uses)


METHODS: dict[str, Method] = {
    "adamw": Method("adamw", 1e-3, build_adamw, "full-rank AdamW (torch.optim.AdamW)", uses=ADAM),
    "adamw-grouped": Method("adamw-grouped", FIRA_LR, build_adamw_grouped,
                            "full-rank AdamW with Fira's step sizes: matrices at alpha * lr, the rest at lr",
                            uses=ADAM | {"alpha"}),
}
for _name, _overrides in fira_optim.VARIANTS.items():
    _what = ", ".join(f"{k}={v!r}" for k, v in _overrides.items()) or "the paper's Fira"
    METHODS[_name] = Method(_name, FIRA_LR, fira_family(_name), f"fira_optim.FiraAdamW with {_what}",
                            uses=fira_uses(_overrides), split_refresh=True)
METHODS.update({
    "lora": Method("lora", 1e-3, build_lora, "peft LoRA on attention + MLP, the rest trained in full",
                   uses=LORA, wraps_model=True),
    "relora": Method("relora", 1e-3, build_relora,
                     "LoRA merged and restarted periodically, moments pruned, jagged LR",
                     uses=LORA | {"relora_every", "relora_prune", "relora_rewarmup"}, wraps_model=True),
    "sgd": Method("sgd", 0.03, build_sgd, "torch.optim.SGD with momentum betas[0]",
                  uses=frozenset({"betas", "weight_decay"})),
    "adagrad": Method("adagrad", 1e-2, build_adagrad, "torch.optim.Adagrad",
                      uses=frozenset({"eps", "weight_decay"})),
    "adam-mini": Method("adam-mini", 1e-3, build_adam_mini, "Adam-mini (the adam-mini package)", uses=ADAM),
    "apollo": Method("apollo", 1e-2, build_apollo,
                     "APOLLO (apollo-torch): channel-wise scaling from a random rank-r projection, scale 1",
                     uses=ADAM | {"rank", "update_proj_gap"}, fsdp2=False),
    "apollo-mini": Method("apollo-mini", 1e-2, build_apollo_mini,
                          "APOLLO-Mini (apollo-torch): tensor-wise scaling from a rank-1 projection, scale 128",
                          uses=ADAM | {"update_proj_gap"}, fsdp2=False),
    "flora": Method("flora", FLORA_LR, build_flora,
                    "Flora (flora-opt): Adafactor with momentum compressed by resampled random projections",
                    uses=frozenset({"rank", "update_proj_gap", "betas", "weight_decay"}), fsdp2=False),
    "slimadam": Method("slimadam", 1e-3, build_slimadam,
                       "SlimAdam: AdamW with the second moment averaged over fan-in/out (paper's Table 1)",
                       uses=ADAM, fsdp2=False),
})
