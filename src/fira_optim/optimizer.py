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
Matrices with ``m > n`` are projected on the right (``R = G Q``) by the ``"std"`` rule, and
the scaling factors are then per row.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from . import compiled, distributed, unprojected
from .limiter import LIMITERS
from .projection import (
    LEFT,
    PROJ_TYPES,
    RIGHT,
    PROJECTORS,
    basis_shape,
    compute_basis,
    low_rank_shape,
    norms,
    project,
    projection_side,
    reduce_dim,
    sq_norms,
)
from .scaling import SCALINGS
from .subspace import BASES, STATE_KEYS
from .update import Hyper, apply_fast, apply_reference, fast_path_supports

ARITHMETICS = ("paper", "released")
RESIDUALS = ("add", "drop", "sign")
NONFINITE = ("error", "skip", "ignore")
IMPLEMENTATIONS = ("fast", "compiled", "reference")


class NonFiniteGradientError(RuntimeError):
    """A gradient holds NaN or Inf; raised before anything is modified."""


class Fira(Optimizer):
    r"""Fira over a pluggable base optimizer (Adam, Adagrad or RMSProp) in the subspace.

    Args:
        params: tensors, or param-group dicts. A group is projected iff it has a non-``None``
            ``rank`` (the released ``fira`` semantics, so ``fira.divide_params`` groups work
            unchanged). A flat iterable of tensors is split into a projected group of its 2-D
            tensors and a plain group with the rest.
        lr: learning rate :math:`\eta` (default 1e-3).
        betas: :math:`(\beta_1, \beta_2)` (default (0.9, 0.999)); RMSProp uses :math:`\beta_2`.
        eps: :math:`\epsilon` of the base optimizer, the scaling factor and the limiter.
        weight_decay: decoupled weight decay :math:`\lambda` (default 0).
        rank: projection rank ``r`` for groups given as tensors (default 128). A matrix with
            ``rank >= min(m, n)`` is trained by the plain base optimizer (no residual exists).
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
        only_scaling: update with :math:`\phi(R) \odot G` alone (Fira-only-scaling).
        clip_norm: threshold of ``limiter="clip"`` (default 1.0).
        mu: :math:`\mu` of ``"shrink"`` / ``"tensorwise"`` (default 0.1).
        align_signs: give each new exact-SVD basis vector the sign that points it along the
            previous basis vector of the same index (:math:`\mathrm{diag}(P_{old}^\top P_{new}) \ge 0`).
            Singular vectors are defined up to sign and LAPACK, cuSOLVER and float precisions
            pick signs differently; the Adam moments carried over a refresh are coordinates in
            the old basis, so an arbitrary flip reverses their first moment along that
            direction. Aligned, the run is the same on every device (default True; the
            released ``fira`` and ``galore-torch`` keep the raw signs: ``False``).
        stagger: spread projection refreshes over the ``T`` steps instead of refreshing every
            matrix on the same step (the first step still initialises every basis).
        correct_bias: Adam bias correction (default True; released API compatibility).
        seed: seed of the random projectors (bases are reproducible across resumes).
        nonfinite: ``"error"`` (raise :class:`NonFiniteGradientError` naming the parameter, before
            anything changes), ``"skip"`` (skip the whole step, warn) or ``"ignore"``.
        implementation: ``"fast"`` (multi-tensor, no ``m x n`` temporaries), ``"compiled"``
            (the fast path with its low-rank arithmetic fused by ``torch.compile``: faster
            steady steps after a one-time compilation; see :mod:`fira_optim.compiled`) or
            ``"reference"`` (every term of Algorithm 1 explicit).
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
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        rank: int | None = 128,
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
        align_signs: bool = True,
        stagger: bool = False,
        correct_bias: bool = True,
        seed: int = 0,
        nonfinite: str = "error",
        implementation: str = "fast",
        split_refresh: bool = False,
        process_group: Any = None,
        host_refresh: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        no_deprecation_warning: bool = True,  # accepted for drop-in use of fira.FiraAdamW
    ):
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, "
                f"but got {torch.typename(params)}"
            )
        _check_choice("nonfinite", nonfinite, NONFINITE)
        _check_choice("implementation", implementation, IMPLEMENTATIONS)
        self.nonfinite = nonfinite
        self.implementation = implementation
        self.split_refresh = bool(split_refresh)
        self.process_group = process_group
        if not isinstance(host_refresh, bool):
            raise ValueError(f"Invalid host_refresh: {host_refresh!r}; expected True or False")
        self.host_refresh = host_refresh
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=None,
            update_proj_gap=update_proj_gap, alpha=alpha, gamma=gamma, proj_type=proj_type,
            projector=projector, arithmetic=arithmetic, base=base, scaling=scaling,
            limiter=limiter, residual=residual, only_scaling=only_scaling, clip_norm=clip_norm,
            mu=mu, align_signs=align_signs, stagger=stagger, correct_bias=correct_bias, seed=seed,
            foreach=foreach, fused=fused,
        )
        _validate_options(defaults)
        if rank is not None:
            _check_rank(rank)
        super().__init__(_split_flat_params(params, rank), defaults)

    # ------------------------------------------------------------------ groups and state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Released semantics: a group without a "rank" key is not projected, whatever the
        # constructor's rank (which only applies to flat tensor lists, via _split_flat_params).
        param_group.setdefault("rank", None)
        if "scale" in param_group and "alpha" not in param_group:  # galore-torch's name
            param_group["alpha"] = param_group["scale"]
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_options(group)
        if group["rank"] is not None:
            _check_rank(group["rank"])
            for index, p in enumerate(group["params"]):
                _check_projectable(p, index, len(self.param_groups) - 1)
        for index, p in enumerate(group["params"]):
            if p.is_complex():
                raise ValueError(
                    f"param_groups[{len(self.param_groups) - 1}]['params'][{index}] is complex "
                    f"({p.dtype}); Fira supports real floating-point parameters only"
                )

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups, so
        # copy.deepcopy and pickle silently reset the constructor's other options to their
        # defaults (a copy of a nonfinite="skip" optimizer raised on NaN, a "reference" one
        # ran the fast path). A process group is not copyable: a copy of a split_refresh
        # optimizer shares its refreshes over the default group.
        state = super().__getstate__()
        state["nonfinite"] = self.nonfinite
        state["implementation"] = self.implementation
        state["host_refresh"] = self.host_refresh
        state["split_refresh"] = self.split_refresh
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("nonfinite", "error")
        self.__dict__.setdefault("implementation", "fast")
        self.__dict__.setdefault("split_refresh", False)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("host_refresh", False)
        for group in self.param_groups:  # state dicts from older versions lack newer keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @staticmethod
    def _process_value_according_to_param_policy(
        param: torch.Tensor, value: torch.Tensor, param_id: int, param_groups: list, key: Any = None
    ) -> torch.Tensor:
        # torch casts loaded state to the parameter's dtype. Our low-rank states and basis of a
        # bf16/fp16 parameter are kept in fp32 on purpose: move them, keep their dtype.
        if key == "step":
            return value
        if key in _PROJECTED_KEYS or value.dtype != param.dtype and value.dtype == torch.float32:
            return value.to(device=param.device)
        return Optimizer._process_value_according_to_param_policy(
            param, value, param_id, param_groups, key
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer.load_state_dict calls its cast policy as
        # Optimizer._process_value_according_to_param_policy (on the base class), so the override
        # above was never reached: the fp32 basis and moments of a bf16/fp16 matrix came back in
        # bf16/fp16 and its next step failed (matmul of bf16 and fp32). Capture the state dict as
        # the load pre-hooks leave it (this hook runs last) and re-take its tensors through our
        # policy.
        seen: dict[str, Any] = {}

        def capture(_optimizer, loaded):
            seen["state_dict"] = loaded

        handle = self.register_load_state_dict_pre_hook(capture)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        loaded = seen["state_dict"]
        saved_ids = [i for g in loaded["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in loaded["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = self._process_value_according_to_param_policy(
                        p, value, saved_id, loaded["param_groups"], key
                    )
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                state = self.state.get(p)
                if state and "basis" in state:
                    _check_loaded_state(p, state, group, gi, pi)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = self._prepare()
        if prepared is None:  # a non-finite gradient with nonfinite="skip"
            return loss
        plans, plain = prepared
        self._apply(plans)
        unprojected.step_groups(plain, self.state)
        return loss

    def _prepare(self):
        """Phase A: new bases and projections for every matrix; nothing is committed until
        every gradient has been checked, so a non-finite gradient leaves everything as it was."""
        plans: list[_Plan] = []
        plain: list[tuple[dict, list[torch.Tensor]]] = []
        checks: list[tuple[torch.Tensor, int, int]] = []
        order = 0  # global index of projected matrices: stagger offsets and projector seeds
        total = None
        if any(g["stagger"] for g in self.param_groups):
            total = sum(1 for g in self.param_groups for p in g["params"] if _is_projected(p, g))
        # FSDP2 shards, or DDP with split_refresh: the refresh bases are computed across ranks
        # first (one rank per matrix, broadcast to all); None in one process and plain DDP.
        shard_group = distributed.shard_group(self.param_groups)
        refresh_group = shard_group if shard_group is not None else self._split_refresh_group()
        refreshed = None
        if refresh_group is not None:
            refreshed = self._refresh_together(refresh_group, total)
        elif self.implementation != "reference":
            refreshed = self._refresh_in_threads(total)
        for gi, group in enumerate(self.param_groups):
            plain_params = []
            hyper = None
            for pi, p in enumerate(group["params"]):
                projected = _is_projected(p, group)
                order += projected
                if p.grad is None or p.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"Fira does not support sparse gradients ({_name(gi, pi, p)})")
                if not projected:
                    # Until its first real step, an all-zero gradient only builds state. Test
                    # the step count, not mere presence of state: a second zero-gradient step
                    # must not count either, or the bias correction of this param runs one
                    # step ahead of the projected matrices (which stay at step 0) and of a
                    # fresh optimizer.
                    state = self.state.get(p)
                    if (state and float(state["step"]) > 0) or bool(p.grad.any()):
                        plain_params.append(p)
                    elif not state:  # build the state, change nothing
                        unprojected.init_state(self.state[p], p, group["base"])
                    if self.nonfinite != "ignore":
                        checks.append((distributed.to_local(p.grad), gi, pi))
                    continue
                hyper = hyper or Hyper.from_group(group)
                plan = self._plan(p, group, gi, pi, order - 1, total, hyper, refreshed)
                if plan is _SKIP_STEP:
                    return None
                if plan is not None:
                    plans.append(plan)
                    if self.nonfinite != "ignore":
                        # Column norms of R: needed by the update anyway, and non-finite iff G
                        # is (a NaN or Inf in g_i reaches r_i = P^T g_i). Checked all at once below.
                        checks.append((plan.low_norm, gi, pi))
            if plain_params:
                plain.append((group, plain_params))
        tensors = [c for c, _, _ in checks]
        flags = _finite_flags(tensors) if checks else None
        local = flags
        if shard_group is not None:
            # FSDP2: R = sum_k P_k^T G_k of the left projections and every shard's finiteness
            # checks, completed in one all-reduce; then the column norms of the whole R.
            left = [pl for pl in plans if pl.sharding is not None and pl.side == LEFT]
            flags = distributed.reduce_partials([pl.low for pl in left], flags, shard_group)
            for pl in left:
                pl.low_norm = norms(pl.low, 0)
        if flags is not None and not bool(flags.all()):  # the step's one host sync
            # Rare: a norm also overflows from finite entries. Decide those entry by entry
            # (and agree across the shards again).
            flags = _recheck_overflow(tensors, local)
            if shard_group is not None:
                flags = distributed.reduce_partials([], flags, shard_group)
        if flags is not None and not bool(flags.all()):
            _, gi, pi = checks[int((~flags).nonzero()[0, 0])]
            self._nonfinite_found(_name(gi, pi, self.param_groups[gi]["params"][pi]))
            return None
        return plans, plain

    def _split_refresh_group(self) -> Any:
        """The process group of ``split_refresh`` (None when off or outside torch.distributed)."""
        if not self.split_refresh:
            return None
        return distributed.process_group_or_world(self.process_group)

    def _due_refreshes(self, total: int | None) -> list[tuple]:
        """``(param, job)`` for every matrix whose basis is due this step, in the order of the
        projected matrices; ``job`` is a :class:`fira_optim.distributed.RefreshJob` holding this
        rank's gradient and the refresh rule (:meth:`_refresh_outcome`) to run on it."""
        due = []
        order = 0
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if not _is_projected(p, group):
                    continue
                order += 1
                if p.grad is None or p.numel() == 0:
                    continue
                state = self.state[p]
                step = int(state["step"]) if state else 0
                if not _refresh_due(group, step, order - 1, total):
                    continue
                work_dtype = torch.promote_types(p.dtype, torch.float32)
                grad = distributed.to_local(p.grad).to(work_dtype)
                side = projection_side(p.shape, group["proj_type"])
                compute = functools.partial(
                    self._refresh_outcome, rank=group["rank"], side=side, group=group,
                    order=order - 1, step=step, name=_name(gi, pi, p),
                )
                previous = distributed.to_local(state["basis"]) if step > 0 else None
                due.append((p, distributed.RefreshJob(
                    grad, p.shape[0], order - 1, previous, side, group["rank"],
                    distributed.row_sharding(p), compute,
                )))
        return due

    def _refresh_together(self, process_group: Any, total: int | None) -> dict:
        """The refresh outcomes of every matrix due this step, computed across the ranks of
        ``process_group`` by :func:`fira_optim.distributed.refresh_bases`, keyed by parameter
        (:func:`_keyed`)."""
        due = self._due_refreshes(total)
        return _keyed(due, distributed.refresh_bases([job for _, job in due], process_group))

    def _refresh_in_threads(self, total: int | None) -> dict | None:
        """One process on the CPU (or on an accelerator with ``host_refresh``): the refresh
        outcomes of every matrix due this step, computed by ``torch.get_num_threads()`` threads
        at once on the host; keyed by parameter (:func:`_keyed`). None (each matrix refreshes in its turn in
        phase A) if fewer than two are due or the gradients are elsewhere than on the CPU
        without ``host_refresh``.

        LAPACK's SVD of a small matrix keeps few cores busy, so decompositions of different
        matrices side by side use the others, each on one intra-op thread. Workers left at
        torch's default each open an OpenMP team of every core inside MKL's LAPACK, and the
        teams oversubscribe the cores: on 2 cores a refresh then often stalled for hundreds of
        milliseconds, even where each matrix takes one (``benchmarks/refresh_threads.py``, ``micro``).
        So each worker sets its own count as it starts (``_one_thread``); the count is per
        thread, and the caller's stays as it was.

        The outcomes are the sequential refresh's calls on the same inputs: bitwise its results
        where LAPACK's do not depend on the thread count (small matrices), else equal to
        round-off, up to a rotation within a group of (nearly) equal singular values (any such
        rotation is exact). A gradient found non-finite is reported in phase A in the usual
        order.
        """
        workers = torch.get_num_threads()
        on_host = all(p.device.type == "cpu" for group in self.param_groups for p in group["params"])
        if workers < 2 or not (on_host or self.host_refresh):
            return None  # before _due_refreshes, which converts every due gradient
        due = self._due_refreshes(total)
        if len(due) < 2:
            return None
        jobs = [job for _, job in due]
        if not on_host:  # blocking copies: the SVDs must see the finished gradients
            inputs = [(job.grad.cpu(), None if job.previous is None else job.previous.cpu()) for job in jobs]
        else:
            inputs = [(job.grad, job.previous) for job in jobs]
        with ThreadPoolExecutor(min(workers, len(due)), initializer=_one_thread) as pool:
            outcomes = list(pool.map(lambda job, args: job.compute(*args), jobs, inputs))
        if not on_host:
            outcomes = [(status, None if basis is None else basis.to(job.grad.device))
                        for (status, basis), job in zip(outcomes, jobs)]
        return _keyed(due, outcomes)

    def _nonfinite_found(self, name: str) -> None:
        """Raise (``nonfinite="error"``) or warn that the step is skipped."""
        if self.nonfinite == "error":
            raise NonFiniteGradientError(
                f"non-finite gradient in {name}; nothing was updated "
                "(pass nonfinite='skip' to skip such steps)"
            )
        warnings.warn(f"non-finite gradient in {name}: step skipped", RuntimeWarning, stacklevel=4)

    def _plan(self, p, group, gi, pi, order, total, hyper, refreshed=None):
        work_dtype = torch.promote_types(p.dtype, torch.float32)
        sharding = distributed.row_sharding(p)  # FSDP2: this rank holds a row block of p, p.grad
        if refreshed is not None and p in refreshed:
            grad = refreshed[p][2]  # converted once, for the refresh
        else:
            grad = p.grad if sharding is None else p.grad.to_local()
            grad = grad if grad.dtype == work_dtype else grad.to(work_dtype)
        side = projection_side(p.shape, group["proj_type"])
        rank = group["rank"]
        state = self.state[p]
        step = int(state["step"]) if state else 0
        new_basis = None
        if _refresh_due(group, step, order, total):
            if refreshed is not None:  # decided on one rank for all (distributed.refresh_bases)
                status, new_basis, _ = refreshed[p]
            else:
                previous = state["basis"] if step > 0 else None
                status, new_basis = self._refresh_outcome(
                    grad, previous, rank=rank, side=side, group=group, order=order, step=step,
                    name=_name(gi, pi, p),
                )
            if status == "nonfinite" and self.nonfinite != "ignore":
                self._nonfinite_found(_name(gi, pi, p))
                return _SKIP_STEP
            if status not in ("new", "keep") and step == 0:
                # Never derive a basis from a zero or non-finite gradient. Before the first
                # basis exists the step is a no-op for this matrix, so the zero-gradient step
                # that torch.distributed.checkpoint uses to build state changes nothing.
                if not state:
                    shape = tuple(p.shape)
                    _init_projected_state(state, p, low_rank_shape(shape, rank, side),
                                          basis_shape(shape, rank, side), hyper, work_dtype, side)
                return None
        basis = new_basis if new_basis is not None else distributed.to_local(state["basis"])
        low = project(grad, basis, side)  # FSDP2 left: this rank's share P_k^T G_k of R
        low_norm = norms(low, reduce_dim(side))
        grad_sq = None
        if (hyper.residual != "drop" and self.implementation != "reference"
                and fast_path_supports(hyper, p, grad)):  # the reference path forms S itself
            # ||g_i||^2 for ||S||, read now while G is still in cache from the projection: on the
            # CPU a second sweep over every gradient later in the step streams it from memory.
            grad_sq = sq_norms(grad, reduce_dim(side))
        return _Plan(p, hyper, grad, low, low_norm, basis, new_basis, side, work_dtype, sharding,
                     grad_sq)

    def _refresh_outcome(self, grad, previous, *, rank, side, group, order, step, name):
        """The refresh rule on a whole gradient: ``(status, basis)``, status one of
        :data:`fira_optim.distributed.REFRESH_STATUSES`. Never a basis from a zero or
        non-finite gradient."""
        if not bool(torch.isfinite(grad).all()):
            return "nonfinite", None
        if not bool(grad.any()):
            return "zero", None
        basis = self._new_basis(grad, rank, side, group, previous, order, step, name)
        return ("new", basis) if basis is not None else ("keep", None)

    def _new_basis(self, grad, rank, side, group, previous, order, step, name):
        generator = torch.Generator().manual_seed(
            (group["seed"] * 1_000_003 + order * 7919 + step) % (2**63)
        )
        try:
            return compute_basis(grad, rank, side, group["projector"], previous, generator,
                                 align_signs=group["align_signs"])
        except RuntimeError as err:
            fallback = "using a random basis" if previous is None else "keeping the previous basis"
            warnings.warn(f"projection basis failed for {name} ({err}); {fallback}", RuntimeWarning)
            if previous is None:
                return compute_basis(grad, rank, side, "random", None, generator)
            return None

    def _apply(self, plans: list["_Plan"]) -> None:
        """Phase B: commit the bases, then the base optimizer, scaling, limiter and update.

        Matrices that share hyper-parameters and step count go through the multi-tensor fast
        path together; the rest (low precision, FRUGAL, ``implementation="reference"``) one by
        one through the reference path.
        """
        # FSDP2 plans work on this rank's blocks (updating the local views updates the
        # DTensors) and complete sums over rows across the shards (row_sum, an all-reduce).
        buckets: dict[tuple[int, int, Any], list[_Plan]] = {}
        for plan in plans:
            p, hp = plan.param, plan.hyper
            state = self.state[p]
            if not state:
                rank, shape = plan.basis.shape[1], tuple(p.shape)
                _init_projected_state(state, p, low_rank_shape(shape, rank, plan.side),
                                      basis_shape(shape, rank, plan.side), hp, plan.work_dtype,
                                      plan.side)
            tensors = state if plan.sharding is None else distributed.local_views(state)
            if plan.new_basis is not None:
                tensors["basis"].copy_(plan.new_basis)
            state["step"] += 1
            step = int(state["step"])
            row_sum = None if plan.sharding is None else plan.sharding.sum
            if self.implementation != "reference" and fast_path_supports(hp, p, plan.grad):
                shards = None if plan.sharding is None else plan.sharding.group
                buckets.setdefault((id(hp), step, shards), []).append(plan)
            else:
                apply_reference(_local(p, plan), plan.grad, plan.low, plan.basis, plan.side,
                                tensors, step, hp, row_sum)
        for (_, step, shards), bucket in buckets.items():
            hp = bucket[0].hyper
            if (self.implementation == "compiled" and shards is None and compiled.supports(hp)
                    and compiled.apply_compiled(
                        [b.param for b in bucket], [b.grad for b in bucket], [b.low for b in bucket],
                        [b.low_norm for b in bucket], [b.basis for b in bucket],
                        [b.side for b in bucket], [self.state[b.param] for b in bucket], step, hp,
                        [b.grad_sq for b in bucket])):
                continue
            row_sum = None if shards is None else bucket[0].sharding.sum
            apply_fast(
                [_local(b.param, b) for b in bucket], [b.grad for b in bucket],
                [b.low for b in bucket], [b.low_norm for b in bucket], [b.basis for b in bucket],
                [b.side for b in bucket], [_local_state(self.state[b.param], b) for b in bucket],
                step, bucket[0].hyper, row_sum, [b.grad_sq for b in bucket],
            )


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


class _Plan:
    """What phase A computed for one matrix, for phase B to commit."""

    __slots__ = ("param", "hyper", "grad", "low", "low_norm", "basis", "new_basis", "side",
                 "work_dtype", "sharding", "grad_sq")

    def __init__(self, param, hyper, grad, low, low_norm, basis, new_basis, side, work_dtype,
                 sharding=None, grad_sq=None):
        self.param, self.hyper, self.grad, self.low, self.low_norm = param, hyper, grad, low, low_norm
        self.basis, self.new_basis, self.side, self.work_dtype = basis, new_basis, side, work_dtype
        # FSDP2: grad, low, basis are this rank's blocks (distributed.RowSharding), else None.
        self.sharding = sharding
        self.grad_sq = grad_sq  # per-column (left) / per-row (right) ||g_i||^2, local rows


def _local(p: torch.Tensor, plan: _Plan) -> torch.Tensor:
    return p if plan.sharding is None else p.to_local()


def _local_state(state: dict, plan: _Plan) -> dict:
    return state if plan.sharding is None else distributed.local_views(state)


_SKIP_STEP = object()


def _keyed(due: list[tuple], outcomes: list[tuple]) -> dict:
    """``{param: (status, basis, grad)}`` from :meth:`Fira._due_refreshes`' ``(param, job)`` pairs
    and their refresh outcomes; ``grad`` is the job's working-dtype gradient, which phase A
    then uses instead of converting ``p.grad`` a second time."""
    return {p: (*outcome, job.grad) for (p, job), outcome in zip(due, outcomes)}


def _one_thread() -> None:
    """A refresh worker's initializer: its own LAPACK calls on one thread (the calling
    thread's count is untouched, ``tests/fira_optim/test_optimizer.py`` checks it)."""
    torch.set_num_threads(1)


def _finite_flags(checks: list[torch.Tensor]) -> torch.Tensor:
    """One bool per tensor, in order: whether its norm is finite, without a host sync.

    A NaN or Inf entry makes a tensor's norm non-finite, so one ``foreach`` norm over all of
    them (a single read of each) clears the common case. The checks are the gradients of the
    unprojected params and the column norms of each R = P^T G (non-finite iff G is). A False
    can also be a norm that overflowed from finite entries: :func:`_recheck_overflow`.
    """
    totals = torch._foreach_norm(checks)
    if any(t.dtype != totals[0].dtype for t in totals):
        totals = [t.float() for t in totals]
    return torch.isfinite(torch.stack(totals))


def _recheck_overflow(checks: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """``flags`` with each False decided entry by entry (whether all entries are finite)."""
    flags = flags.clone()
    for i in (~flags).nonzero().flatten().tolist():
        flags[i] = torch.isfinite(checks[i]).all()
    return flags


_PROJECTED_KEYS = {"basis", "prev_norm", *(k for keys in STATE_KEYS.values() for k in keys)}


def _name(gi: int, pi: int, p: torch.Tensor) -> str:
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"


def _is_projected(p: torch.Tensor, group: dict) -> bool:
    rank = group["rank"]
    return rank is not None and p.dim() == 2 and rank < min(p.shape)


def _init_projected_state(state, p, low_shape, basis_shape_, hp: Hyper, dtype, side) -> None:
    # Tensors only, created with their final shapes: weights_only loads, and a state dict
    # taken after a zero-gradient step already has the layout of a trained one. For an FSDP2
    # parameter they are DTensors of these global shapes: rows follow p's shards for P (left)
    # and for the states of R = G Q (right), the rest is replicated.
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in STATE_KEYS[hp.base]:
        state[key] = distributed.state_zeros(p, low_shape, dtype, row_sharded=side == RIGHT)
    state["basis"] = distributed.state_zeros(p, basis_shape_, dtype, row_sharded=side == LEFT)
    if hp.residual != "drop":
        state["prev_norm"] = distributed.state_zeros(p, (), dtype, row_sharded=False)


def _refresh_due(group: dict, step: int, order: int, total: int | None) -> bool:
    """Whether matrix number ``order`` (of ``total``, counted under ``stagger``) takes a new
    basis at ``step``."""
    period = group["update_proj_gap"]
    offset = (order * period) // total if group["stagger"] else 0
    return step == 0 or (step - offset) % period == 0


def _split_flat_params(params, rank):
    params = list(params)
    if len(params) == 0:
        raise ValueError("optimizer got an empty parameter list")
    if all(isinstance(p, dict) for p in params):
        return params
    if any(isinstance(p, dict) for p in params):
        raise TypeError("params must be all tensors or all dicts, not a mix")
    matrices = [p for p in params if p.dim() == 2] if rank is not None else []
    others = [p for p in params if rank is None or p.dim() != 2]
    groups = []
    if matrices:
        groups.append({"params": matrices, "rank": rank})
    if others:
        groups.append({"params": others, "rank": None})
    return groups


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r}; expected one of {choices}")


def _check_rank(rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"Invalid rank: {rank!r}; expected a positive int (or None for no projection)")


def _validate_options(g: dict) -> None:
    """Range checks shared by the constructor and add_param_group; each names the argument."""
    lr = g["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate (lr): {g['lr']}")
    if not 0.0 <= g["eps"]:
        raise ValueError(f"Invalid epsilon value (eps): {g['eps']}")
    betas = g["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas}; each must be in [0, 1)")
    if not 0.0 <= g["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {g['weight_decay']}")
    gap = g["update_proj_gap"]
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
        raise ValueError(f"Invalid update_proj_gap: {gap!r}; expected an int >= 1")
    if not g["alpha"] > 0:
        raise ValueError(f"Invalid alpha: {g['alpha']}; expected > 0")
    if not g["gamma"] >= 1.0:
        raise ValueError(f"Invalid gamma: {g['gamma']}; expected >= 1 (use limiter='none' to disable)")
    if not g["clip_norm"] > 0:
        raise ValueError(f"Invalid clip_norm: {g['clip_norm']}; expected > 0")
    if not 0.0 < g["mu"] <= 1.0:
        raise ValueError(f"Invalid mu: {g['mu']}; expected in (0, 1]")
    if not isinstance(g["align_signs"], bool):
        raise ValueError(f"Invalid align_signs: {g['align_signs']!r}; expected True or False")
    _check_choice("proj_type", g["proj_type"], PROJ_TYPES)
    _check_choice("projector", g["projector"], PROJECTORS)
    _check_choice("arithmetic", g["arithmetic"], ARITHMETICS)
    _check_choice("base", g["base"], BASES)
    _check_choice("scaling", g["scaling"], SCALINGS)
    _check_choice("limiter", g["limiter"], LIMITERS)
    _check_choice("residual", g["residual"], RESIDUALS)
    if g["arithmetic"] == "released" and g["base"] != "adam":
        raise ValueError(f"arithmetic='released' exists only for base='adam', got base={g['base']!r}")
    if not g["correct_bias"] and g["arithmetic"] == "paper" and g["base"] == "adam":
        raise ValueError("correct_bias=False is only available with arithmetic='released'")
    for key in ("foreach", "fused"):
        if g.get(key) is not None and not isinstance(g[key], bool):
            raise ValueError(f"Invalid {key}: {g[key]!r}; expected None, True or False")
    if g.get("fused") and g.get("foreach"):
        raise ValueError("foreach=True and fused=True cannot be set together (as in torch.optim.AdamW)")
    if g.get("fused") and (g["base"] != "adam" or g["arithmetic"] != "paper"):
        raise ValueError(f"fused=True is torch's fused AdamW: it needs base='adam' and arithmetic='paper', "
                         f"got base={g['base']!r}, arithmetic={g['arithmetic']!r}")


def _check_projectable(p: torch.Tensor, index: int, group_index: int) -> None:
    where = f"param_groups[{group_index}]['params'][{index}]"
    if distributed.is_flat_parameter(p):
        raise ValueError(f"{where} is a FlatParameter of {distributed.FSDP1_MESSAGE}")
    if p.dim() != 2:
        raise ValueError(
            f"{where} has shape {tuple(p.shape)}: a projected "
            "group (rank set) takes 2-D weight matrices only; put other tensors in a group with "
            "rank=None (fira_optim.param_groups does this). 1-D views of 2-D weights (FSDP1 flat "
            "parameters, ZeRO partitions) cannot be projected: shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose parameters stay 2-D."
        )
    distributed.row_sharding(p)  # a DTensor must be row-sharded (FSDP2): ValueError otherwise


def _check_loaded_state(p, state, group, gi, pi) -> None:
    name = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
    side = projection_side(p.shape, group["proj_type"])
    rank = group["rank"]
    want = basis_shape(tuple(p.shape), rank, side)
    if tuple(state["basis"].shape) != want:
        raise ValueError(
            f"loaded projection basis of {name} has shape {tuple(state['basis'].shape)}, "
            f"expected {want} for rank={rank}, proj_type={group['proj_type']!r}"
        )
    low = low_rank_shape(tuple(p.shape), rank, side)
    for key in STATE_KEYS[group["base"]]:
        if key not in state or tuple(state[key].shape) != low:
            got = tuple(state[key].shape) if key in state else "missing"
            raise ValueError(f"loaded state {key!r} of {name} is {got}, expected shape {low}")
