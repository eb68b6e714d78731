r"""The Fira optimizer: one class, every variant of the paper as a setting.

.. math::
    \begin{aligned}
    &\textbf{input: } \eta, \beta_1, \beta_2, \epsilon, \lambda, r, T, \alpha, \gamma \\
    &\textbf{for } t = 0, 1, \dots: \\
    &\quad G_t \leftarrow \nabla_W f_t(W_t) \\
    &\quad \textbf{if } t \bmod T = 0: \ U, \Sigma, V^\top \leftarrow \mathrm{SVD}(G_t),\ P_t \leftarrow U_{:, :r}
      \quad \textbf{else } P_t \leftarrow P_{t-1} \\
    &\quad R_t \leftarrow P_t^\top G_t, \quad S_t \leftarrow G_t - P_t R_t \\
    &\quad N_t \leftarrow \psi_t(R_t) \quad \text{(Adam on } R_t\text{, bias-corrected)} \\
    &\quad \phi_i \leftarrow \|N_{t,:,i}\| / (\|R_{t,:,i}\| + \epsilon), \quad S_t \leftarrow S_t \operatorname{diag}(\phi) \\
    &\quad S_t \leftarrow S_t \cdot \gamma / \max(\|S_t\| / (\|S_{t-1}\| + \epsilon), \gamma) \\
    &\quad W_{t+1} \leftarrow (1 - \eta\lambda) W_t - \eta\,\alpha\,(P_t N_t + S_t)
    \end{aligned}

(Algorithm 1 of Chen et al., "Fira: Can We Achieve Full-rank Training of LLMs under
Low-rank Constraint?", NeurIPS 2025; weight decay decoupled as in ``torch.optim.AdamW``.)
Matrices with ``m >= n`` are projected on the right (``R = G Q``) by the ``"std"`` rule, and
the scaling factors are then per row.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from . import distributed, loading, precision, refresh, unprojected
from .compiled import COMPILED
from .finite import NonFiniteGradientError, finite_flags, recheck_overflow
from .options import (
    Base,
    Hyper,
    Implementation,
    NonFinite,
    Residual,
    StateDtype,
    check_process_options,
    check_rank,
    check_state_rounding,
    caller_level,
    check_torch_only,
    misspelt_option,
    param_name,
    validate_group,
)
from .pipeline import FAST, REFERENCE, MatrixStats, MatrixStep, Strategy
from .projection import (
    LEFT,
    RIGHT,
    basis_shape,
    is_projected,
    low_rank_shape,
    projected_rank,
    project,
    projection_side,
    reduce_dim,
    sq_norms,
)
from .subspace import STATE_KEYS

__all__ = ["Fira", "FiraAdamW", "GaLoreAdamW", "NonFiniteGradientError"]


class _DefaultRank(int):
    """The constructor's default rank, 128, told apart from a ``rank=128`` the caller passed."""

    def __repr__(self) -> str:
        return "128"


#: The constructor's default ``rank``: applied to a flat list of tensors; dict groups take the
#: constructor's ``rank`` only when the caller passes it and none sets its own (see
#: :func:`_split_flat_params`). Told apart by type, so that a copy of it is the default too.
DEFAULT_RANK = _DefaultRank(128)


class Fira(Optimizer):
    r"""Fira over a pluggable base optimizer (Adam, Adagrad or RMSProp) in the subspace.

    Args:
        params: tensors, or param-group dicts. A group is projected iff it has a non-``None``
            ``rank`` (the released ``fira`` semantics, so ``fira.divide_params`` groups work
            unchanged). A flat iterable of tensors is split into a projected group of its 2-D
            tensors and a plain group with the rest; so is each dict group when ``rank`` is
            passed explicitly and no group sets its own (as torch's keywords are the defaults of
            the groups: a Hugging Face Trainer's decay / no-decay groups). A group added later
            with ``add_param_group`` is projected iff it sets ``rank``. Dict groups none of
            which sets ``rank``, without ``rank=``, are all plain AdamW (their ``base``'s plain
            optimizer): a ``UserWarning`` says so where they hold a matrix (``rank=None`` is the way
            to mean it).
        lr: learning rate :math:`\eta` (default 1e-3).
        betas: :math:`(\beta_1, \beta_2)` (default (0.9, 0.999)); RMSProp uses :math:`\beta_2`.
        eps: :math:`\epsilon` of the base optimizer, the scaling factor and the limiter (default
            1e-8, ``torch.optim.AdamW``'s; ``fira`` 1.0.2 and ``galore-torch`` default to 1e-6).
            Under ``arithmetic="released"`` the scaling factor and the limiter use a fixed 1e-8,
            as ``fira`` 1.0.2 does.
        weight_decay: decoupled weight decay :math:`\lambda` (default 0).
        rank: projection rank ``r`` for tensors, and when passed, for dict groups none of
            which sets its own (default 128, for tensors only). A matrix with
            ``rank >= min(m, n)`` is trained by the plain base optimizer (no residual exists),
            but under ``only_scaling``, which projects on all ``min(m, n)`` directions; a
            group none of whose matrices is projected gets a ``UserWarning``.
        update_proj_gap: ``T``, steps between projection refreshes (default 200).
        alpha: :math:`\alpha`, GaLore's scale of the update (default 0.25).
        gamma: :math:`\gamma` of the norm-growth limiter (default 1.01).
        proj_type: ``"std"`` (right if ``m >= n`` else left), ``"reverse_std"``, ``"left"``, ``"right"``.
        projector: ``"svd"`` (exact, the paper), ``"randomized"`` (subspace iteration warm-started
            from the previous basis), ``"random"`` (orthonormal Gaussian; the w.o.-SVD ablation).
        arithmetic: ``"paper"`` (Algorithm 1) or ``"released"`` (``fira`` 1.0.2: residual
            ``G - alpha P R``, bias correction in the step size, weight decay after the update).
        base: ``"adam"``, ``"adagrad"`` or ``"rmsprop"``: the optimizer run on ``R``.
        scaling: ``"column"`` (Fira), ``"matrix"`` (Fira-matrix) or ``"none"`` (:math:`\phi = 1`).
        limiter: ``"growth"`` (Fira), ``"none"``, ``"clip"`` (``clip_norm``), ``"shrink"`` or
            ``"tensorwise"`` (``mu``): the stabilisers compared in the paper's ablation.
        residual: ``"add"`` (Fira), ``"drop"`` (GaLore) or ``"sign"`` (FRUGAL's signSGD).
        only_scaling: update with :math:`\phi(R) \odot G` alone (Fira-only-scaling); at any
            rank, ``min(m, n)`` and above included (there, :math:`\phi` comes from all
            ``min(m, n)`` directions: the full-rank column of the paper's rank ablation).
        clip_norm: threshold of ``limiter="clip"`` (default 1.0).
        mu: :math:`\mu` of ``"shrink"`` / ``"tensorwise"`` (default 0.1).
        align_signs: give each new exact-SVD basis vector the sign that points it along the
            previous basis vector of the same index (:math:`\mathrm{diag}(P_{old}^\top P_{new}) \ge 0`).
            Singular vectors are defined up to sign, and LAPACK, cuSOLVER and float precisions
            pick signs differently; the Adam moments carried over a refresh are coordinates in
            the old basis, so a flip reverses their first moment along that direction. Default
            False: the raw SVD signs, as in Algorithm 1, the released ``fira`` and ``galore-torch``.
            Aligning is not in the paper, and on ``tiny`` over three seeds it measured no better
            (validation perplexity 2.3 higher, test not separated; docs/optimizer.md). ``True``
            makes each basis independent of the SVD library's sign choice, and lets the SVD take
            the QR-first route (:func:`fira_optim.projection.svd_basis`).
        stagger: spread projection refreshes over the ``T`` steps instead of refreshing every
            matrix on the same step (the first step still initialises every basis).
        correct_bias: Adam bias correction (default True; released API compatibility).
        seed: seed of the random projectors and of stochastic rounding (reproducible across resumes).
        state_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"int8"`` (block-wise quantized,
            needs torchao): how the moments of every parameter and the basis (bf16 at most) are
            stored; the arithmetic stays fp32 (:mod:`fira_optim.precision`). At ``"float32"``
            the moments of a parameter that is not projected take its own dtype, as
            ``torch.optim.AdamW``'s do (bf16 for bf16 weights; fp32 for fp16 ones).
        state_rounding: how the moments are written into bf16 states: ``"nearest"`` (default)
            or ``"stochastic"`` (uniform noise in the 16 bits cut off, so that small changes to
            a moment are kept on average: nearest rounding stalls Adam's second moment at
            ``beta2 = 0.999``; seeded as ``stochastic_rounding``, on streams of their own). Needs
            ``state_dtype="bfloat16"``; the basis is rounded to nearest. May change between
            steps.
        stochastic_rounding: write the updates of bf16 parameters by stochastic rounding
            (default False: round to nearest).
        nonfinite: ``"error"`` (raise :class:`NonFiniteGradientError` naming the parameter, before
            anything changes), ``"skip"`` (skip the whole step, warn) or ``"ignore"``.
        implementation: the strategy that runs the stages (:mod:`fira_optim.pipeline`):
            ``"fast"`` (multi-tensor, no ``m x n`` temporaries), ``"compiled"`` (the fast
            strategy with stages 3-6 fused by ``torch.compile`` after a one-time compilation;
            see :mod:`fira_optim.compiled`) or ``"reference"`` (one matrix
            at a time, every term of Algorithm 1 explicit).
        split_refresh: under DDP, deal the refresh SVDs round-robin to the ranks of
            ``process_group`` and broadcast the bases, so a refresh costs ``1/N`` of the SVD work
            per rank (default False: every rank computes every basis). FSDP2 (DTensor) parameters
            always refresh this way. See :mod:`fira_optim.distributed`.
        process_group: the group of ``split_refresh`` (default: the default group).
        host_refresh: decompose the refresh SVDs of gradients held on an accelerator on the
            host CPU instead: gradients copied to the host, the SVDs run side by side in
            ``torch.get_num_threads()`` single-thread workers (as on the CPU), the bases copied
            back. cuSOLVER's SVD of the matrices of a small model is bound by launch and
            iteration latency, and a host with many cores does the same exact SVDs in a
            fraction of the time (``benchmarks/refresh_host.py`` measures both on your machine).
            One process only: ``split_refresh`` and FSDP2 refresh on the devices (default False).
        amsgrad, maximize, capturable, differentiable, decoupled_weight_decay:
            ``torch.optim.AdamW``'s options, accepted at its defaults (False, and True for
            ``decoupled_weight_decay``) so that its keywords pass through; Fira implements none
            of the others, and refuses them.

    Inside a ``torch.compile`` of the caller (a compiled training step), the step runs the
    reference implementation: the fast strategy's fused kernels and refresh threads cannot be
    traced, and the compiler fuses the explicit terms itself, in pieces between graph breaks (the
    step reads values on the host): ``fullgraph=True`` is refused by torch.compile.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        rank: int | None = DEFAULT_RANK,
        update_proj_gap: int = 200,
        alpha: float = 0.25,
        gamma: float = 1.01,
        proj_type: str = "std",
        projector: str = "svd",
        arithmetic: str = "paper",
        base: str = "adam",
        scaling: str = "column",
        limiter: str = "growth",
        residual: str = "add",
        only_scaling: bool = False,
        clip_norm: float = 1.0,
        mu: float = 0.1,
        align_signs: bool = False,
        stagger: bool = False,
        correct_bias: bool = True,
        seed: int = 0,
        nonfinite: str = "error",
        implementation: str = "fast",
        split_refresh: bool = False,
        process_group: Any = None,
        host_refresh: bool = False,
        state_dtype: str = "float32",
        state_rounding: str = "nearest",
        stochastic_rounding: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        no_deprecation_warning: bool = True,  # accepted for drop-in use of fira.FiraAdamW
        # torch.optim.AdamW's own options, accepted at its defaults (AdamW(...).defaults passed
        # on as keywords works); Fira implements none of them otherwise: a ValueError says so.
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        decoupled_weight_decay: bool = True,
    ):
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, "
                f"but got {torch.typename(params)}"
            )
        check_process_options(nonfinite, implementation, host_refresh, split_refresh)
        self.nonfinite = NonFinite(nonfinite).value
        self.implementation = Implementation(implementation).value
        self.split_refresh = split_refresh
        self.process_group = process_group
        self.host_refresh = host_refresh
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=None,
            update_proj_gap=update_proj_gap, alpha=alpha, gamma=gamma, proj_type=proj_type,
            projector=projector, arithmetic=arithmetic, base=base, scaling=scaling,
            limiter=limiter, residual=residual, only_scaling=only_scaling, clip_norm=clip_norm,
            mu=mu, align_signs=align_signs, stagger=stagger, correct_bias=correct_bias, seed=seed,
            state_dtype=state_dtype, state_rounding=state_rounding, stochastic_rounding=stochastic_rounding,
            foreach=foreach, fused=fused,
        )
        validate_group({**defaults, "amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                        "differentiable": differentiable, "decoupled_weight_decay": decoupled_weight_decay})
        if state_dtype == StateDtype.INT8:
            precision.require_int8()
        explicit = not isinstance(rank, _DefaultRank)  # a copy of the default is the default too
        if rank is not None:
            rank = check_rank(rank)
        self._stats_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._in_backward = None  # the handle of fira_optim.step_in_backward, while registered
        groups = _split_flat_params(params, rank, explicit)
        unranked = not any("rank" in group for group in groups)  # dict groups, no rank= (add_param_group sets it)
        super().__init__(groups, defaults)
        if unranked:
            _warn_if_unranked_groups_hold_matrices(self.param_groups)

    # ------------------------------------------------------------------ groups and state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        # Released semantics: a group without a "rank" key is not projected, whatever the
        # constructor's default rank (which applies to flat tensor lists, and to the dict groups
        # of a constructor given rank=, via _split_flat_params).
        param_group.setdefault("rank", None)
        if "scale" in param_group and "alpha" not in param_group:  # galore-torch's name
            param_group["alpha"] = param_group["scale"]
        count = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._check_new_group(count)
            if self._in_backward is not None:  # its parameters are updated in the backward pass too
                self._in_backward.cover(param_group["params"])  # (refused if another handle updates one)
        except Exception:  # a refused group is not kept: step() would train it as given
            del self.param_groups[count:]
            self.__dict__.get("_unrounded_warned", set()).discard(count)  # the next group there is another
            raise

    def _warn_unrounded(self, gi: int, stacklevel: int) -> None:
        """A warning, once per group, where ``stochastic_rounding`` is on for a group holding fp16
        parameters (rounded to nearest: it is of bf16 ones), or no bf16 parameter at all (it
        changes nothing there: fp32 weights take the update exactly). At the constructor, and at
        the step for a group switched to it in ``param_groups`` since (a scan of its parameters
        only then). Marked by the group's index, which a load (new group dicts) keeps."""
        group = self.param_groups[gi]
        warned = self.__dict__.setdefault("_unrounded_warned", set())
        if not group["stochastic_rounding"] or gi in warned:
            return
        warned.add(gi)
        halves = [index for index, p in enumerate(group["params"]) if p.dtype == torch.float16]
        if halves:
            warnings.warn(f"param_groups[{gi}] holds {len(halves)} float16 parameters (the first: ['params']"
                          f"[{halves[0]}]): stochastic_rounding applies to bfloat16 parameters only, these are "
                          "rounded to nearest", UserWarning, stacklevel=stacklevel)
        elif group["params"] and not any(p.dtype == torch.bfloat16 for p in group["params"]):
            dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in group["params"]}))
            warnings.warn(f"param_groups[{gi}] holds no bfloat16 parameter ({dtypes} only): stochastic_rounding "
                          "rounds the updates of bfloat16 weights and changes nothing here", UserWarning,
                          stacklevel=stacklevel)

    def _check_new_group(self, gi: int) -> None:
        """The checks of the group just appended as ``param_groups[gi]`` (torch's
        ``add_param_group`` has filled in its defaults)."""
        group = self.param_groups[gi]
        validate_group(group)
        for key in group:
            option = misspelt_option(key, self.defaults)
            if option is not None:  # torch keeps unknown keys: a misspelt option would be ignored
                warnings.warn(f"param_groups[{gi}] has the key {key!r}, which the optimizer does not read (did you "
                              f"mean {option!r}?): the group trains with {option}={group[option]!r}", UserWarning,
                              stacklevel=caller_level())
        if group["state_dtype"] == StateDtype.INT8:
            precision.require_int8()
            for index, p in enumerate(group["params"]):
                if distributed.is_dtensor(p):
                    raise ValueError(f"{param_name(gi, index, p, group, shape=False)} is a DTensor: "
                                     "state_dtype='int8' is not supported with FSDP2 yet "
                                     "(its blocks do not follow the shards); use 'bfloat16'")
        if group["rank"] is not None:
            group["rank"] = check_rank(group["rank"])
            for index, p in enumerate(group["params"]):
                _check_projectable(p, index, gi, group)
            _warn_if_nothing_projected(group, gi)
        self._warn_unrounded(gi, stacklevel=4)
        for index, p in enumerate(group["params"]):
            # A rank=None group with fp32 states takes complex parameters, as torch.optim.AdamW
            # does (real views of them); a subspace of a complex matrix is not defined here.
            if p.dtype == torch.complex32:  # fp16 halves: its moments would underflow (fp16 keeps fp32 ones)
                raise ValueError(f"{param_name(gi, index, p, group, shape=False)} is complex32; use complex64")
            if p.is_complex() and (group["rank"] is not None or group["state_dtype"] != StateDtype.FLOAT32):
                raise ValueError(
                    f"{param_name(gi, index, p, group, shape=False)} is complex ({p.dtype}); Fira projects real "
                    f"floating-point parameters only: put complex ones in a group with rank=None and "
                    f"state_dtype='float32' (got rank={group['rank']!r}, state_dtype={group['state_dtype']!r})"
                )

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups, so
        # copy.deepcopy and pickle silently reset the constructor's other options to their
        # defaults (a copy of a nonfinite="skip" optimizer raised on NaN, a "reference" one
        # ran the fast path). A process group is not copyable: a copy of a split_refresh
        # optimizer shares its refreshes over the default group. Stats hooks are not copied.
        state = super().__getstate__()
        state["nonfinite"] = self.nonfinite
        state["implementation"] = self.implementation
        state["host_refresh"] = self.host_refresh
        state["split_refresh"] = self.split_refresh
        if "_built_options" in self.__dict__:  # a copy refuses the same option changes as the original
            state["_built_options"] = self.__dict__["_built_options"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("nonfinite", "error")
        self.__dict__.setdefault("implementation", "fast")
        self.__dict__.setdefault("split_refresh", False)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("host_refresh", False)
        self.__dict__.setdefault("_stats_hooks", OrderedDict())
        self.__dict__.setdefault("_in_backward", None)
        for group in self.param_groups:  # state dicts from older versions lack newer keys
            for key, value in self.defaults.items():
                if key != "differentiable":  # torch's __setstate__ adds it to the defaults
                    group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer.load_state_dict casts every loaded state tensor to its
        # parameter's dtype. The low-rank states and basis of a bf16/fp16 matrix are kept in
        # fp32 on purpose, and that cast would lose them (the next step then multiplied bf16
        # by fp32). So capture the state dict as the load pre-hooks leave it (this hook runs
        # last), let torch load it, then re-take its tensors in the dtypes this optimizer
        # keeps for each parameter now (_state_dtypes: a model cast to another dtype since the
        # save steps on), before any load post-hook runs (a user's hook sees, and may replace,
        # the final states). Older step counters and the released package's state are
        # converted, and a state dict of another layout (rank, side rule, base; torch's AdamW)
        # refused, before torch reads it.
        seen: dict[str, Any] = {}

        def capture(_optimizer, loaded):
            loading.check_structure(loaded)
            loading.check_layout(self.param_groups, loaded)
            loading.check_values(self.param_groups, loaded)
            loading.warn_replaced_algorithm(self.param_groups, loaded)
            loading.warn_released_arithmetic(self.param_groups, loaded)
            seen["state_dict"] = loading.upgraded(loaded, self.param_groups)
            loading.check_group_options(seen["state_dict"])
            return seen["state_dict"]

        def retake(_optimizer) -> None:
            self._retake_loaded(seen["state_dict"])

        pre = self.register_load_state_dict_pre_hook(capture)
        post = self.register_load_state_dict_post_hook(retake, prepend=True)
        # torch replaces the state and the groups (new objects) before the post-hooks check the
        # loaded states: a refused load puts the ones it replaced back (a caller that catches the
        # error trains on as before, not on a half-loaded state)
        before = {name: self.__dict__[name] for name in ("state", "param_groups")}
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            self.__dict__.update(before)
            raise
        finally:
            pre.remove()
            post.remove()
        # The loaded groups, states and ranks replace the ones the cached layout was built for
        # (a rank the load set is not a rank changed during training); the loaded states are
        # built for the loaded groups' options.
        self.__dict__.pop("_layout", None)
        self._record_built()

    def _retake_loaded(self, loaded: dict[str, Any]) -> None:
        """The loaded states checked against each group's options and taken by this optimizer's
        dtype policy (see load_state_dict; :meth:`_settle_states`)."""
        saved_ids = [i for g in loaded["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self._settle_states("loaded state", {p: loaded["state"].get(i, {}) for i, p in zip(saved_ids, params)})

    @property
    def in_backward(self) -> Any:
        """The :func:`fira_optim.step_in_backward` handle updating this optimizer's parameters in
        the backward pass (None: none; :meth:`step` updates them)."""
        return self._in_backward

    def register_step_stats_hook(self, hook: Callable[["Fira", list[MatrixStats]], None]) -> RemovableHandle:
        r"""Call ``hook(optimizer, stats)`` after every step, with one
        :class:`fira_optim.pipeline.MatrixStats` per projected matrix updated in it (its
        strategy, :math:`\|S_t\|` and limiter factor, as tensors). The measurement hook for
        benchmarks and analyses: nothing is collected while no hook is registered. Under
        :func:`fira_optim.step_in_backward` a step is one update per parameter: the hook is called
        after each, with that matrix's stats (an empty list for a parameter not projected).
        Returns a handle whose ``remove()`` unregisters it."""
        handle = RemovableHandle(self._stats_hooks)
        self._stats_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Algorithm 1 for every projected matrix, plain AdamW (or the base) for the rest.

        Stages 1-2 (refresh, project) as the step is planned, after which every gradient has
        been checked, so a non-finite one leaves everything as it was; then stages 3-7 by each
        matrix's strategy (:mod:`fira_optim.pipeline`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is None:
            self._step_params(None)
        else:  # the hooked parameters were updated in the backward pass; the rest here
            rest = self._in_backward.uncovered()
            if rest:
                kept = self._in_backward.unscaled(rest)  # under loss scaling: those that did not overflow
                if kept:
                    self._step_params(set(kept))
                self._in_backward.cover(rest)  # unfrozen since the hooks were registered
            self._in_backward.stepped()
        return loss

    @torch.no_grad()
    def _step_params(self, only: set | None) -> None:
        """One step of the parameters in ``only`` (all when None): the body of :meth:`step`,
        and what :func:`fira_optim.step_in_backward` runs as each gradient is complete."""
        planned = self._plan_step(only)
        if planned is None:  # a non-finite gradient with nonfinite="skip"
            return
        matrices, plain = planned
        stats: list[MatrixStats] | None = [] if self._stats_hooks else None
        self._update(matrices, stats)
        # each parameter's place among all groups' (the layout _plan_step built): its rounding seed
        unprojected.step_groups(plain, self.state, self.__dict__["_layout"][2])
        if stats is not None:
            for hook in list(self._stats_hooks.values()):
                hook(self, stats)

    def _plan_step(self, only: set | None = None) -> tuple[list[tuple[MatrixStep, Hyper]], list] | None:
        """Stages 1-2 of every matrix (of ``only``, if given), and the finiteness checks:
        ``(matrices, plain)``, or None if the step is skipped. Nothing is committed here."""
        matrices: list[tuple[MatrixStep, Hyper]] = []
        checks: list[tuple[torch.Tensor, int, int]] = []
        # options that may have been set in param_groups since: torch's own, and state_rounding
        for gi, group in enumerate(self.param_groups):
            try:
                check_torch_only(group)
                check_state_rounding(group)
            except ValueError as err:
                raise ValueError(f"param_groups[{gi}]: {err}") from None
            self._warn_unrounded(gi, stacklevel=5)
        entries, total = self._entries(only)
        for gi, pi, p, _ in entries:  # before anything is computed (a frozen int8 weight is fine)
            if p.grad is not None and not (p.is_floating_point() or p.is_complex()):
                raise ValueError(f"{param_name(gi, pi, p, self.param_groups[gi])} has dtype {p.dtype} and a gradient: "
                                 "only floating-point (and, with rank=None, complex) parameters can be optimized")
        # FSDP2 shards, or DDP with split_refresh: the refresh bases are computed across ranks
        # first (one rank per matrix, broadcast to all); None in one process and plain DDP.
        shard_group = distributed.shard_group(
            self.param_groups if only is None else [{"params": [p for _, _, p, _ in entries]}])
        refresh_group = shard_group if shard_group is not None else self._split_refresh_group()
        refreshed = None
        if refresh_group is not None:
            refreshed = refresh.refresh_together(self, refresh_group, total, only)
        elif self._running() != Implementation.REFERENCE:
            refreshed = refresh.refresh_in_threads(self, total, only)
        hypers: dict[int, Hyper] = {}
        plain_of: dict[int, list[torch.Tensor]] = {}
        # the plain parameters before their first real step: is their gradient all zero? (decided
        # over every shard of an FSDP2 parameter, the same on every rank)
        first = [p for _, _, p, order in entries if order is None and p.grad is not None and p.numel()
                 and not p.grad.is_sparse and not (self.state.get(p) and float(self.state[p]["step"]) > 0)]
        signal = dict(zip(map(id, first), distributed.nonzero_gradients(first)))
        for gi, pi, p, order in entries:
            group = self.param_groups[gi]
            projected = order is not None
            if p.grad is None or p.numel() == 0:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"Fira does not support sparse gradients ({param_name(gi, pi, p, group)})")
            if not projected:
                # Until its first real step, an all-zero gradient only builds state. Test
                # the step count, not mere presence of state: a second zero-gradient step
                # must not count either, or the bias correction of this param runs one
                # step ahead of the projected matrices (which stay at step 0) and of a
                # fresh optimizer.
                state = self.state.get(p)
                if signal.get(id(p), True):  # not in ``signal``: past its first real step
                    plain_of.setdefault(gi, []).append(p)
                elif not state:  # build the state, change nothing
                    unprojected.init_state(self.state[p], p, group)
                if self.nonfinite != NonFinite.IGNORE:
                    checks.append((distributed.to_local(p.grad), gi, pi))
                continue
            hyper = hypers.get(gi) or hypers.setdefault(gi, Hyper.from_group(group))
            matrix = self._plan_matrix(p, group, gi, pi, order, total, hyper, refreshed)
            if matrix is _SKIP_STEP:
                return None
            if matrix is not None:
                matrices.append((matrix, hyper))
                if self.nonfinite != NonFinite.IGNORE:
                    # Column norms of R: needed by the update anyway, and non-finite iff G
                    # is (a NaN or Inf in g_i reaches r_i = P^T g_i). Checked all at once below.
                    checks.append((matrix.low_norm, gi, pi))
        plain = [(self.param_groups[gi], params) for gi, params in sorted(plain_of.items())]
        tensors = [c for c, _, _ in checks]
        flags = finite_flags(tensors) if checks else None
        local = flags
        if shard_group is not None:
            # FSDP2: R = sum_k P_k^T G_k of the left projections and every shard's finiteness
            # checks, completed in one all-reduce; then the column norms of the whole R.
            left = [m for m, _ in matrices if m.sharding is not None and m.side == LEFT]
            flags = distributed.reduce_partials([m.low for m in left], flags, shard_group)
            for m in left:
                m.low_norm = m.strategy.column_norms(m.low, 0)
        if flags is not None and not bool(flags.all()):  # the step's one host sync
            # Rare: a norm also overflows from finite entries. Decide those entry by entry
            # (and agree across the shards again).
            flags = recheck_overflow(tensors, local)
            if shard_group is not None:
                flags = distributed.reduce_partials([], flags, shard_group)
        if flags is not None and not bool(flags.all()):
            _, gi, pi = checks[int((~flags).nonzero()[0, 0])]
            p = self.param_groups[gi]["params"][pi]
            # A projected matrix is checked through the norms of R, which also overflow from a
            # finite G of huge entries: then say so (the step cannot be computed either way).
            self._nonfinite_found(param_name(gi, pi, p, self.param_groups[gi]), p,
                                  _largest_if_finite(p.grad, shard_group))
            return None
        return matrices, plain

    def _entries(self, only: set | None) -> tuple[list[tuple], int | None]:
        """``[(gi, pi, p, order)]`` of every parameter (of ``only``), in param-group order, with
        ``order`` the index among the projected matrices (None: not projected), and the number
        of projected matrices when a group staggers its refreshes (else None). The layout is
        cached, so that an update in the backward pass (one parameter) costs no scan of all;
        with it each parameter's dtype and shape: a parameter cast since (``model.to(dtype)``
        mid-training), or given data of another shape (``p.data = ...``), is a new layout, whose
        building re-takes the states in the dtypes kept for the parameters' dtypes now (and
        checks them against the shapes), as a load would (also after a load, a copy or a pickle,
        which leave no cached layout). Building it checks the options the states are built for
        against the record of them that survives those (:meth:`_record_built`), and the states
        themselves against the groups (:meth:`_settle_states`)."""
        options = self._group_options()
        # the rank's type too: 3.0 equals 3, and would step on unchecked; only_scaling too: it
        # projects a matrix of rank >= min(m, n) that the others train whole (the states are then
        # checked against it: set during training, the step went on with the old layout)
        key = tuple((id(g["params"]), len(g["params"]), g["stagger"], type(g["rank"]), bool(g.get("only_scaling")),
                     *opts) for g, opts in zip(self.param_groups, options))
        cached = self.__dict__.get("_layout")
        if cached is None or cached[0] != key or not self._layout_holds(cached, only):
            built = self.__dict__.get("_built_options")
            # groups removed since: they cannot be paired by place (the states' check below stands)
            if built is not None and len(built) <= len(options) and built != options:
                self._check_group_changes(built, options)
            for gi, group in enumerate(self.param_groups):
                if group["rank"] is not None:  # a rank set in param_groups: as the constructor checks it
                    try:
                        group["rank"] = check_rank(group["rank"])
                    except ValueError as err:
                        raise ValueError(f"param_groups[{gi}]: {err}") from None
            # also where no record of the options is left to compare; states cast with their parameters
            self._settle_states("state")
            entries, order = [], 0
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.is_meta:  # the update would fail deep inside on .item(): say what went wrong
                        raise ValueError(
                            f"{param_name(gi, pi, p, group)} is on the meta device: "
                            "build the optimizer after model.to_empty(device=...) and the weights' initialization "
                            "or loading (to_empty gives the model new parameters; an optimizer built before it "
                            "holds the meta ones)")
                    if group["rank"] is not None:  # one appended to a projected group's list since: as add_param_group
                        _check_projectable(p, pi, gi, group)
                    projected = is_projected(p, group)
                    entries.append((gi, pi, p, order if projected else None))
                    order += projected
            stagger = any(g["stagger"] for g in self.param_groups)
            position = {p: i for i, (_, _, p, _) in enumerate(entries)}
            # the shape too: data of another shape (p.data = ...) failed midway, inside the stages
            dtypes = {p: (p.dtype, p.shape) for _, _, p, _ in entries}
            cached = (key, entries, position, order if stagger else None, dtypes)
            self.__dict__["_layout"] = cached
            self._record_built()  # after the ranks' normalization above
        _, entries, position, total, _ = cached
        if only is not None:
            entries = [entries[i] for i in sorted(position[p] for p in only)]
        return entries, total

    def _check_group_changes(self, before: list[tuple], after: list[tuple]) -> None:
        """A ``rank``, ``state_dtype``, ``proj_type``, ``base`` or ``residual`` set in
        ``param_groups`` since the states were built (the last step, or the load) is refused
        once the group has states (built for the old one: a new rank failed the step midway,
        some matrices updated and others not; a new state_dtype failed inside torch after the
        weight decay, or kept the old states without a word; a new side, base or residual rule
        looked for states the old one does not keep, after the step counters or the weight
        decay had moved)."""
        for gi, (old, new) in enumerate(zip(before, after)):  # groups added since: add_param_group checked them
            group = self.param_groups[gi]
            for position, name in enumerate(_BUILT_OPTIONS):
                if old[position] != new[position] and any(self.state.get(p) for p in group["params"]):
                    raise ValueError(
                        f"param_groups[{gi}]['{name}'] changed from {old[position]!r} to {new[position]!r} after "
                        f"the group's states were built for the old {name}; it cannot change during training "
                        "(set it back, or build a new optimizer)")

    def _group_options(self) -> list[tuple]:
        """Each group's options that its states are built for (:data:`_BUILT_OPTIONS`)."""
        return [tuple(g[name] for name in _BUILT_OPTIONS) for g in self.param_groups]

    def _record_built(self) -> None:
        """Record :meth:`_group_options`, which a copy, a pickle and a load keep (the cached
        layout they drop names tensors)."""
        self.__dict__["_built_options"] = self._group_options()

    def _settle_states(self, what: str, sources: dict | None = None) -> None:
        """Each parameter's state checked against its group now (:func:`_check_state`: a load of
        another layout, or an option changed after the states were built where no record of it
        was left to compare, a group removed before it), then re-taken in the dtypes this
        optimizer keeps for the parameter's dtype now (:func:`_loaded_value`: int8 codes stay
        codes, the fp32 states of a bf16 matrix stay fp32, the others follow the parameter): from
        ``sources`` (``{param: values}``, a load's) or from the held state (a ``model.to(dtype)``
        since). One probe of the kept dtypes per parameter; run when the layout is built and on a
        load: rarely. ``what`` names the state in an error."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                values = self.state.get(p) if sources is None else sources.get(p)
                if not values:
                    continue
                kept = _state_dtypes(p, group)
                _check_state(p, values, group, kept, what, param_name(gi, pi, p, group, shape=False))
                for key, value in dict(values).items():
                    if isinstance(value, torch.Tensor):
                        self.state[p][key] = _loaded_value(p, value, key, kept.get(key), self.state[p][key])

    def _layout_holds(self, cached: tuple, only: set | None) -> bool:
        """Whether the cached layout still names the tensors of the groups' lists (a parameter
        replaced in a list is a new layout): all of them for a whole step, those of ``only`` for
        an update in the backward pass (a replacement's own hook finds it missing)."""
        _, entries, position, _, dtypes = cached
        if only is not None:
            if any(p not in position for p in only):
                return False
            entries = [entries[position[p]] for p in only]
        return all(self.param_groups[gi]["params"][pi] is p and (p.dtype, p.shape) == dtypes[p]
                   for gi, pi, p, _ in entries)

    def _split_refresh_group(self) -> Any:
        """The process group of ``split_refresh`` (None when off or outside torch.distributed)."""
        if not self.split_refresh:
            return None
        return distributed.process_group_or_world(self.process_group)

    def _nonfinite_found(self, name: str, p: torch.Tensor, overflow: float | None = None) -> None:
        """Raise (``nonfinite="error"``) or warn that the step is skipped; ``overflow``: the
        largest entry of a finite gradient whose projection's norms overflowed. Where the
        parameter ``p`` itself is not finite, say so: its gradient is then the symptom."""
        what = (f"non-finite gradient in {name}" if overflow is None else
                f"gradient of {name} too large for its dtype (finite, largest entry {overflow:.3g}, but "
                "the norms of its projection overflow)")
        if overflow is None and not bool(torch.isfinite(distributed.to_local(p.detach())).all()):
            # (no ";" here: the harness's one-line error ends the place at the first one)
            what += (" (the parameter itself holds NaN or Inf, written by an earlier step or by code outside the "
                     "optimizer: eps=0 writes them on a gradient entry that is 0, as torch.optim.AdamW does)")
        handle = self._in_backward
        if self.nonfinite == NonFinite.ERROR:
            done = 0 if handle is None else handle.updated_besides(p)
            kept = ("nothing was updated" if not done else
                    f"this parameter was not updated, but the {done} others updated in the backward pass since the "
                    "last optimizer.step() keep their update (step_in_backward updates each as its gradient is "
                    "complete)")
            raise NonFiniteGradientError(f"{what}; {kept} (pass nonfinite='skip' to skip such steps)")
        if handle is None:
            warnings.warn(f"{what}: step skipped", RuntimeWarning, stacklevel=4)
        elif not handle.skip_warned:  # each matrix is skipped on its own in the backward pass: one warning a step
            handle.skip_warned = True
            warnings.warn(f"{what}: its update skipped (and that of any other matrix whose gradient is not finite "
                          "in this step, without a warning each)", RuntimeWarning, stacklevel=4)

    def _strategy(self, hyper: Hyper, p: torch.Tensor, grad: torch.Tensor) -> Strategy:
        """The strategy of one matrix: the configured one where it covers the matrix, else the
        reference (FRUGAL's sign residual; a low-precision parameter is no reason: :meth:`_update`
        hands every strategy a working-dtype copy of it)."""
        implementation = self._running()
        if implementation == Implementation.REFERENCE or not FAST.supports(hyper, p, grad):
            return REFERENCE
        return COMPILED if implementation == Implementation.COMPILED else FAST

    def _running(self) -> str:
        """The implementation this step runs: the configured one, but the reference inside a
        ``torch.compile`` of the caller (a compiled training step): the fast strategy's fused
        multi-tensor kernels and refresh threads cannot be traced, and the compiler fuses the
        reference's explicit terms itself."""
        return Implementation.REFERENCE.value if torch.compiler.is_compiling() else self.implementation

    def _plan_matrix(self, p, group, gi, pi, order, total, hyper, refreshed=None):
        """Stages 1-2 of one matrix: a :class:`MatrixStep`, None (no update: no basis yet
        and none derivable from this gradient) or ``_SKIP_STEP``."""
        work_dtype = torch.promote_types(p.dtype, torch.float32)
        sharding = distributed.row_sharding(p)  # FSDP2: this rank holds a row block of p, p.grad
        own = p.grad if sharding is None else p.grad.to_local()
        grad = own if own.dtype == work_dtype else own.to(work_dtype)
        side = projection_side(p.shape, group["proj_type"])
        rank = projected_rank(p.shape, group)
        state = self.state[p]
        step = int(state["step"]) if state else 0
        new_basis = None
        if refresh.refresh_due(group, step, order, total):
            if refreshed is not None:  # decided for all at once (pool or across ranks)
                status, new_basis = refreshed[p]
            else:
                previous = state["basis"] if step > 0 else None
                status, new_basis = refresh.refresh_outcome(
                    grad, previous, rank=rank, side=side, group=group, order=order, step=step,
                    name=param_name(gi, pi, p, group),
                )
            if status == "nonfinite" and self.nonfinite != NonFinite.IGNORE:
                self._nonfinite_found(param_name(gi, pi, p, group), p)
                return _SKIP_STEP
            if status not in ("new", "keep") and step == 0:
                # Never derive a basis from a zero or non-finite gradient. Before the first
                # basis exists the step is a no-op for this matrix, so the zero-gradient step
                # that torch.distributed.checkpoint uses to build state changes nothing.
                if not state:
                    _init_projected_state(state, p, rank, side, hyper, work_dtype)
                return None
        if new_basis is not None and new_basis.dtype != precision.basis_dtype(hyper.state_dtype, work_dtype):
            # The refresh step projects with the basis as it is stored (bf16), as every step up to
            # the next refresh does: a bf16 basis is orthonormal only to about 2**-8, so G - P R
            # holds a leak of the in-subspace gradient that an fp32 one does not, and a refresh
            # step without it left the limiter a history that the next step's norm far exceeded.
            new_basis = new_basis.to(precision.basis_dtype(hyper.state_dtype, work_dtype))
        basis = new_basis if new_basis is not None else distributed.to_local(state["basis"])
        if basis.dtype != work_dtype:  # stored in bf16 (state_dtype)
            basis = basis.to(work_dtype)
        strategy = self._strategy(hyper, p, grad)
        rounding = None
        if group["stochastic_rounding"] and p.dtype == torch.bfloat16:
            # FSDP2: this rank's rows draw their own bits (as a plain parameter's shard does)
            rounding = precision.rounding_generator(group["seed"], order, step, p.device, precision.shard_offset(p))
        low = project(grad, basis, side)  # FSDP2 left: this rank's share P_k^T G_k of R
        dim = reduce_dim(side)
        low_norm = strategy.column_norms(low, dim)
        grad_sq = None
        if hyper.residual is not Residual.DROP and not strategy.explicit:
            # ||g_i||^2 for ||S||, read now while G is still in cache from the projection: on the
            # CPU a second sweep over every gradient later in the step streams it from memory.
            grad_sq = sq_norms(grad, dim)
        # A low-precision gradient's fp32 copy is dropped here and made again for its update:
        # held until then, the copies of every matrix would coexist (twice the bf16 weights).
        lazy = own.dtype != work_dtype
        return MatrixStep(param=p, local=p if sharding is None else p.to_local(),
                          grad=None if lazy else grad, source=own if lazy else None,
                          side=side, basis=basis, new_basis=new_basis, low=low, low_norm=low_norm,
                          strategy=strategy, work_dtype=work_dtype, sharding=sharding,
                          grad_sq=grad_sq, order=order, rounding=rounding)

    def _update(self, matrices: list[tuple[MatrixStep, Hyper]], stats) -> None:
        """Commit the new bases and step counts, then stages 3-7: one matrix at a time for the
        reference strategy, for low-precision states (decoded to fp32, updated, encoded back:
        only one matrix's fp32 moments exist at once) and for low-precision gradients and
        parameters (only one matrix's fp32 gradient and working copy exist at once), in buckets of matrices that share
        hyper-parameters, step count, strategy and shard group otherwise."""
        buckets: dict[tuple, list[MatrixStep]] = {}
        for m, hp in matrices:
            state = self.state[m.param]
            if not state:
                _init_projected_state(state, m.param, m.basis.shape[1], m.side, hp, m.work_dtype)
            m.state = state if m.sharding is None else distributed.local_views(state)
            if m.new_basis is not None:
                m.state["basis"].copy_(m.new_basis)
            state["step"] += 1
            step = int(state["step"])
            row_sum = None if m.sharding is None else m.sharding.sum
            lazy = m.source is not None
            if lazy:
                m.grad = m.source.to(m.work_dtype)
            weights = None
            if m.local.dtype != m.work_dtype:
                # A low-precision (bf16) parameter: every strategy updates a working-dtype copy,
                # rounded into it once (stochastically with m.rounding), so the update's terms
                # are not each rounded to bf16; one matrix's copy exists at a time.
                weights, m.local = m.local, m.local.to(m.work_dtype)
            if hp.state_dtype is not StateDtype.FLOAT32:
                stored, keys = m.state, STATE_KEYS[hp.base]
                # seeded by the step count before this update, as the weights' rounding; the
                # offsets of the moments' own blocks (state, not its local views)
                moments = precision.state_generators(hp.state_rounding, state, keys, hp.seed, m.order, step - 1)
                m.state = precision.decode(stored, keys, m.work_dtype)
                m.strategy.run([m], step, hp, row_sum, stats)
                precision.encode(stored, m.state, keys, moments)
            elif m.strategy.explicit or lazy or weights is not None:
                m.strategy.run([m], step, hp, row_sum, stats)
            else:
                shards = None if m.sharding is None else m.sharding.group
                buckets.setdefault((id(hp), step, m.strategy.name, shards), []).append((m, hp))
            if weights is not None:
                precision.round_into(weights, m.local, m.rounding)
                m.local = weights
            if lazy:
                m.grad = None
        for (_, step, _, _), bucket in buckets.items():
            batch = [m for m, _ in bucket]
            first = batch[0]
            row_sum = None if first.sharding is None else first.sharding.sum
            first.strategy.run(batch, step, bucket[0][1], row_sum, stats)


class FiraAdamW(Fira):
    """Fira with Adam in the subspace (the paper's main algorithm); see :class:`Fira`."""


class GaLoreAdamW(Fira):
    """GaLore: Fira's machinery with the residual dropped (``W -= lr * alpha * P N``).

    Accepts galore-torch's group key ``scale`` as an alias of ``alpha``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **kwargs: Any):
        kwargs.setdefault("residual", "drop")
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)


# ---------------------------------------------------------------------- helpers


_SKIP_STEP = object()

#: The group options a group's states are built for: one changed once it has states is refused.
_BUILT_OPTIONS = ("rank", "state_dtype", "proj_type", "base", "residual")


def _largest_if_finite(grad: torch.Tensor, shard_group: Any) -> float | None:
    """The largest magnitude of a gradient whose entries are all finite, None if one is not;
    over every shard under FSDP2 (each rank holds its rows, possibly none: every rank of the
    shard group calls this, since the finiteness flags they act on are the same)."""
    local = distributed.to_local(grad)
    found = torch.stack([(~torch.isfinite(local)).any().double(),  # float64: a float64 gradient's largest entry
                         local.abs().amax().double() if local.numel() else local.new_zeros((), dtype=torch.float64)])
    if shard_group is not None:
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=shard_group)
    nonfinite, largest = found.tolist()
    return None if nonfinite else largest


def _state_dtypes(p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.dtype]:
    """The dtype of each state tensor this optimizer creates for ``p`` in ``group``, but the step
    count: read off the state the init functions build for a meta tensor of ``p``'s shape and
    dtype (no memory), so the load follows the one rule that makes fresh states."""
    probe = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
    state: dict[str, torch.Tensor] = {}
    if is_projected(probe, group):
        side = projection_side(probe.shape, group["proj_type"])
        _init_projected_state(state, probe, projected_rank(probe.shape, group), side, Hyper.from_group(group),
                              torch.promote_types(p.dtype, torch.float32))
    else:
        unprojected.init_state(state, probe, group)
    return {key: value.dtype for key, value in state.items() if key != "step"}


def _loaded_value(param: torch.Tensor, value: torch.Tensor, key: Any, dtype: torch.dtype | None,
                  current: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor as this optimizer keeps it: the step count as saved, a known state
    in ``dtype`` (its dtype for this parameter now: the fp32 states of a bf16 matrix stay fp32,
    a model cast since the save gets its states cast too, int8 codes stay codes) on the
    parameter's device; an unknown key (a subclass's) as torch's load left it (``current``), but
    an fp32 state of a lower-precision parameter, kept fp32."""
    if key == "step":
        return value
    if dtype is None:
        keep = value.dtype == torch.float32 and value.dtype != param.dtype
        return value.to(device=param.device) if keep else current
    numeric = value.is_floating_point() or value.is_complex()
    if numeric and (dtype.is_floating_point or dtype.is_complex) and value.dtype != dtype:
        return value.to(device=param.device, dtype=dtype)
    return value.to(device=param.device)


def _init_projected_state(state, p, rank: int, side: str, hp: Hyper, dtype) -> None:
    """Zero state of its final shapes and storage (``state_dtype``)."""
    # Tensors only, created with their final shapes: weights_only loads, and a state dict
    # taken after a zero-gradient step already has the layout of a trained one. For an FSDP2
    # parameter they are DTensors of these global shapes: rows follow p's shards for P (left)
    # and for the states of R = G Q (right), the rest is replicated.
    shape = tuple(p.shape)
    low_shape, basis_shape_ = low_rank_shape(shape, rank, side), basis_shape(shape, rank, side)
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in STATE_KEYS[hp.base]:
        state.update(precision.moment_zeros(
            low_shape, hp.state_dtype, dtype, p.device, key,
            make=lambda shape, dt: distributed.state_zeros(p, shape, dt, row_sharded=side == RIGHT)))
    state["basis"] = distributed.state_zeros(p, basis_shape_, precision.basis_dtype(hp.state_dtype, dtype),
                                             row_sharded=side == LEFT)
    if hp.residual is not Residual.DROP:
        state["prev_norm"] = distributed.state_zeros(p, (), dtype, row_sharded=False)


def _split_flat_params(params, rank, explicit: bool):
    """The param groups torch's constructor gets: a flat list split into its projectable 2-D
    tensors (``rank``) and the rest (``rank=None``). Dict groups as given (released semantics:
    one without ``rank`` is not projected), but where the caller passed ``rank`` explicitly and
    no group sets its own: that is then, as in torch, the default of the groups, each split the
    same way (a Hugging Face Trainer's decay / no-decay groups with ``rank=16`` are projected).
    Groups of which one sets ``rank`` (``divide_params``, galore-torch's) are taken as given: the
    others are their plain groups on purpose (embeddings, head)."""
    params = list(params)
    if len(params) == 0:
        raise ValueError("optimizer got an empty parameter list")
    if any(isinstance(p, dict) for p in params) and not all(isinstance(p, dict) for p in params):
        raise TypeError("params must be all tensors or all dicts, not a mix")
    if not isinstance(params[0], dict):
        return _split(params, rank, {})
    if not explicit or any("rank" in group for group in params):
        return params
    groups = []
    for gi, group in enumerate(params):
        given = group.get("params")
        if isinstance(given, set):  # torch refuses sets too, but only after this split would have run
            raise TypeError(f"param group {gi}: 'params' is a set, whose order changes from run to run (a "
                            "saved state would then load into other tensors): give a list")
        tensors = [given] if isinstance(given, torch.Tensor) else list(given or [])
        options = {k: v for k, v in group.items() if k != "params"}
        groups += _split(tensors, rank, options) or [group]
    return groups


def _split(params: list, rank: int | None, options: dict) -> list[dict]:
    """``params`` as a projected group of the 2-D real tensors (``rank``) and a plain group of
    the rest, each with ``options``; an empty part is left out."""
    def projectable(item) -> bool:  # a tensor, or a (name, tensor) pair of model.named_parameters()
        tensor = item[1] if isinstance(item, tuple) else item
        # anything else (a module, a number) goes to the plain group: torch's add_param_group
        # refuses it there with its own TypeError, as torch.optim.AdamW does
        return (rank is not None and isinstance(tensor, torch.Tensor) and tensor.dim() == 2
                and not tensor.is_complex())

    matrices = [p for p in params if projectable(p)]
    others = [p for p in params if not projectable(p)]
    groups = []
    if matrices:
        groups.append({**options, "params": matrices, "rank": rank})
    if others:
        groups.append({**options, "params": others, "rank": None})
    return groups


def _warn_if_unranked_groups_hold_matrices(groups: list[dict[str, Any]]) -> None:
    """Dict groups none of which sets ``rank``, without ``rank=``, are all plain AdamW (the
    released fira's rule: a group is projected iff it has a ``rank``), whatever the constructor's
    default rank says. torch's keywords are the defaults of the groups, so a torch user's decay /
    no-decay groups (or a Hugging Face Trainer's, through ``optimizer_cls_and_kwargs``) trained
    without a single projection, and without a word: a warning where they hold a matrix."""
    if not any(p.dim() == 2 and p.is_floating_point() for group in groups for p in group["params"]):
        return
    who = "the param group does not set" if len(groups) == 1 else f"none of the {len(groups)} param groups sets"
    # an unprojected group steps with its base optimizer (torch's, weight decay decoupled)
    plain = " / ".join(dict.fromkeys(_PLAIN_BASE[Base(group["base"])] for group in groups))
    warnings.warn(f"{who} 'rank', and rank= was not passed: a dict group is projected only with a "
                  "'rank' of its own (as in the released fira), so nothing is projected and the optimizer is plain "
                  f"{plain}. Pass rank=r to project each group's 2-D tensors, set 'rank' in the groups "
                  f"(fira_optim.param_groups(model)), or pass rank=None where plain {plain} is meant",
                  UserWarning, stacklevel=caller_level())


#: What a group that is not projected steps with, by its ``base`` (decoupled weight decay).
_PLAIN_BASE = {Base.ADAM: "AdamW", Base.ADAGRAD: "Adagrad", Base.RMSPROP: "RMSprop"}


def _warn_if_nothing_projected(group: dict[str, Any], group_index: int) -> None:
    """A projected group none of whose matrices is projected (``rank >= min(m, n)`` for each:
    e.g. a rank meant for a wider model) trains as the plain base optimizer, with full-rank
    states: legitimate (Fira at full rank), but worth a word, as the memory saving is gone."""
    params = group["params"]
    if not params or any(is_projected(p, group) for p in params):
        return
    widest = max(min(p.shape) for p in params)
    each = "its matrix" if len(params) == 1 else f"each of its {len(params)} matrices"
    warnings.warn(f"param_groups[{group_index}]: rank={group['rank']} is >= min(m, n) of {each} (the "
                  f"largest min(m, n) is {widest}): none is projected, so the group trains as the plain "
                  "base optimizer with full-rank states", UserWarning, stacklevel=caller_level())


def _check_projectable(p: torch.Tensor, index: int, group_index: int, group: dict[str, Any]) -> None:
    where = param_name(group_index, index, p, group, shape=False)  # by its name too, where it has one
    if distributed.is_flat_parameter(p):
        raise ValueError(f"{where} is a FlatParameter of {distributed.FSDP1_MESSAGE}")
    if p.dim() != 2:
        raise ValueError(
            f"{where} has shape {tuple(p.shape)}: a projected "
            "group (rank set) takes 2-D weight matrices only; put other tensors in a group with "
            "rank=None, e.g. [{'params': [p for p in ps if p.dim() == 2], 'rank': r}, "
            "{'params': [p for p in ps if p.dim() != 2]}], or build the groups with "
            "fira_optim.param_groups(model, rank=r) (a flat list of tensors is split this way "
            "by itself). 1-D views of 2-D weights (FSDP1 flat "
            "parameters, ZeRO partitions) cannot be projected: shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose parameters stay 2-D."
        )
    distributed.row_sharding(p)  # a DTensor must be row-sharded (FSDP2): ValueError otherwise


def _check_state(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], kept: dict[str, torch.dtype],
                 what: str, where: str) -> None:
    """ValueError unless ``state`` is what ``group`` keeps for ``p``: a projected matrix's basis
    and low-rank moments of its rank and side, a plain parameter's moments of its shape, and int8
    codes (with their scales) where the group stores them, floats where it does not (a state
    built under another ``state_dtype`` was kept as it was, under the new one's name). The
    message names ``what`` (``"loaded state"``) ``of where`` (the parameter's place)."""
    shape = tuple(p.shape)
    # what every step reads (a moment stored as int8 codes keeps its name): a state without one
    # loaded, and the next step failed with a bare KeyError
    for key in ("step", *STATE_KEYS[group["base"]]):
        if key not in state:
            raise ValueError(f"{what} of {where} (shape {shape}) has no {key!r}, which every step of "
                             f"base={group['base']!r} reads")
    # a matrix of rank >= min(m, n) is projected under only_scaling alone (fira-optim before that
    # trained it whole under only_scaling too): say so, rather than blame a rank that did not change
    whole_rank = group["rank"] is not None and p.dim() == 2 and group["rank"] >= min(shape)
    if is_projected(p, group):
        if "basis" not in state:
            why = (" with only_scaling=True, which projects a matrix of rank >= min(m, n) on all its min(m, n) "
                   "directions (the state was built without only_scaling, or by a fira-optim that trained such a "
                   "matrix whole under only_scaling too)" if whole_rank else "")
            raise ValueError(f"{what} of {where} (shape {shape}) has no projection basis: it was built for a "
                             f"parameter its group does not project, and the group now has rank={group['rank']!r}"
                             f"{why}")
        _check_projected_state(p, state, group, what, f"{where} (shape {shape})")
    elif "basis" in state:
        why = (" without only_scaling, which alone projects a matrix of rank >= min(m, n) (the state was built "
               "under only_scaling=True)" if whole_rank else "")
        if p.dim() != 2:  # never projected: the state is another parameter's
            why = (f"; a {p.dim()}-D parameter is never projected, so the state is another parameter's: are the "
                   "groups, or the parameters in them, in another order than when the state was saved?")
        raise ValueError(f"{what} of {where} (shape {shape}) holds a projection basis: it was built for a projected "
                         f"matrix, and its group now has rank={group['rank']!r}{why}")
    else:  # a plain parameter's moments have its shape (else the step fails midway)
        for key, value in state.items():
            if key in precision.SIGNED and tuple(value.shape) != shape:
                raise ValueError(f"{what} {key!r} of {where} has shape {tuple(value.shape)}, expected the "
                                 f"parameter's {shape}")
    for key, dtype in kept.items():  # _state_dtypes(p, group)
        value, coded = state.get(key), not (dtype.is_floating_point or dtype.is_complex)
        if value is None and (coded or key.endswith("_scale")):
            raise ValueError(f"{what} of {where} has no {key!r}, which state_dtype={group['state_dtype']!r} keeps")
        if isinstance(value, torch.Tensor) and coded != (not (value.is_floating_point() or value.is_complex())):
            raise ValueError(f"{what} {key!r} of {where} is {value.dtype}, where state_dtype="
                             f"{group['state_dtype']!r} keeps {dtype}: it was built under another state_dtype")


def _check_projected_state(p, state, group, what: str, where: str) -> None:
    side = projection_side(p.shape, group["proj_type"])
    rank = projected_rank(p.shape, group)
    want = basis_shape(tuple(p.shape), rank, side)
    if tuple(state["basis"].shape) != want:
        raise ValueError(
            f"{what} 'basis' of {where} has shape {tuple(state['basis'].shape)}, "
            f"expected {want} for rank={rank}, proj_type={group['proj_type']!r}"
        )
    low = low_rank_shape(tuple(p.shape), rank, side)
    for key in STATE_KEYS[group["base"]]:
        if key not in state or tuple(state[key].shape) != low:
            got = tuple(state[key].shape) if key in state else "missing"
            raise ValueError(f"{what} {key!r} of {where} is {got}, expected shape {low}")
