r"""Each matrix's update inside the backward pass, so that full gradients never coexist.

:func:`step_in_backward` registers a post-accumulate-grad hook on every parameter of a
:class:`fira_optim.Fira`: as soon as backward has finished a parameter's gradient, the hook runs
that parameter's whole step (refresh, projection, Adam on ``R``, scaling, limiter, commit) and
frees the gradient. At most one layer's full gradients exist at a time instead of the whole
model's: the memory of the gradients drops from the model's size to its largest few matrices.
``optimizer.step()`` becomes a no-op for the hooked parameters (keep calling it: schedulers and
step hooks expect it, and it updates the parameters no hook covers: those that did not require a
gradient when the hooks were registered and were unfrozen since, which it hooks for the next
backward pass; a group added with ``add_param_group`` is hooked as it is added). Under DDP the
communication hook updates every parameter of the optimizer that DDP all-reduces (the model's
others are left to their own optimizer); ``step()`` updates the others (not in the model, or
frozen when DDP was built and so never reduced) from their local gradients, as a plain DDP step
would.

A parameter is updated in the backward pass by one handle at a time: a handle over a parameter
that another active handle updates (a second optimizer over the same weights, a second Trainer on
the same model) is a ValueError, not a second update in each backward; so is an optimizer that lists
a tensor twice (a weight tied to another, listed for each module), which ``step()`` updates twice
a step, as torch's optimizers do, and the backward pass once.

What stays the same: learning-rate schedulers (the hooks read ``param_groups`` when they run),
``state_dict`` / ``load_state_dict`` and exact resume, projection refreshes (each matrix counts
its own steps, as it always has). With one micro-batch per step, in one process, the weights
after N steps equal ``step()``'s bit for bit.

What changes:

- **Gradient accumulation**: wrap the backward passes of the non-final micro-batches in
  ``with handle.accumulate():``; their gradients accumulate as usual and the final backward
  updates. The accumulated gradients are then alive across micro-batches: accumulation keeps
  the memory of a whole model's gradients, as without this feature. Every backward outside
  ``accumulate()`` is a whole update: a loop that accumulates without it (a Hugging Face
  ``Trainer`` with ``gradient_accumulation_steps > 1``) updates once per micro-batch. The first
  parameter updated twice between two ``optimizer.step()`` calls gets a ``UserWarning``. Outside
  DDP, a final micro-batch run inside ``accumulate()`` loses nothing: ``optimizer.step()``
  then updates what was accumulated, as a plain step would; under DDP nothing was all-reduced,
  nothing is updated, and ``optimizer.step()`` warns.
- **Several backward passes through one graph** (``retain_graph=True``: two losses of one
  forward pass, each with its own ``backward()``): the first pass updates the weights in place,
  and the next, which needs them as they were, fails in torch ("one of the variables needed for
  gradient computation has been modified by an inplace operation"); where it needs none, each
  pass is a whole update (warned as above). Run every pass but the last inside
  ``accumulate()``, or call ``backward()`` on the sum of the losses: the gradients then add up,
  as for a plain step, and the last pass updates.
- **Non-finite gradients** are found per matrix, as each update runs: ``nonfinite="error"``
  raises from inside backward (matrices updated earlier in the same backward keep their update);
  ``"skip"`` skips that matrix's update only, and warns once per step (of the first).
- **Step hooks** (``register_step_pre_hook``, ``register_step_post_hook`` and torch's global
  ones) run around ``optimizer.step()``, after the hooked parameters were updated and their
  gradients freed: a pre-hook that clips gradients or changes the learning rate acts on the next
  step's updates at the earliest. :func:`step_in_backward` warns of a pre-hook registered on the
  optimizer when it is called.
- **Gradient clipping by the global norm** cannot work (the norm of all gradients exists only
  after the last of them, when most updates are done; ``clip_grad_norm_`` after backward finds
  the gradients freed and returns 0, so a Trainer logs a gradient norm of 0): Fira's
  norm-growth limiter bounds each matrix's residual update instead; clip per matrix in your own
  hook if you need more.
- **Loss scaling** for fp16 autocast: ``torch.amp.GradScaler`` cannot work (the hooks would
  update from the scaled gradients before ``scaler.unscale_`` sees them, and ``scaler.step``
  then finds no gradients: "No inf checks were recorded"). Pass ``loss_scale="dynamic"`` (or a
  number, a static scale) instead and call ``handle.scale(loss).backward()``; each update divides
  its own gradients by the scale, with GradScaler's kernels, and the scale moves at each
  ``optimizer.step()`` as GradScaler's does (:mod:`fira_optim.loss_scale`). An overflow skips
  the updates whose gradients overflowed, not the whole step (those before it are done). Not
  under FSDP2 (each rank would see its own shard overflow); bf16 autocast needs no scaling.
- **DDP**: pass the DDP model, or ``torch.compile``'s wrapper of it, not the module inside it
  (without it the hooks update from each rank's own gradients, before DDP averages them, and the
  first ``optimizer.step()`` finds the averaged gradients DDP wrote back: a RuntimeError). The
  update then runs in DDP's communication hook, on each bucket's all-reduced (averaged)
  gradients, instead of the local ones; DDP's buckets still
  hold the model's gradients, so the memory saving under DDP is the optimizer's temporaries, not
  the gradients. Use ``model.no_sync()`` (``handle.accumulate()`` enters it) for accumulation.
  The communication hook stays registered after ``remove()`` (DDP cannot unregister one); it
  then only all-reduces, as DDP's default, until a new handle on the same DDP model takes it over.
- **FSDP2**: the hooks run on the sharded parameters after FSDP2's reduce-scatter, on this
  rank's rows of the reduced gradient; under ``accumulate()`` the reduce-scattered gradients
  accumulate in the shards, and the final micro-batch's hook updates.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch

from . import distributed
from .loss_scale import _FP16_GRADIENTS, LossScale, check_scale
from .options import param_name

if TYPE_CHECKING:
    from .optimizer import Fira


class StepInBackward:
    """The handle :func:`step_in_backward` returns."""

    def __init__(self, optimizer: "Fira", model: Any = None, loss_scale: Any = None):
        if optimizer._in_backward is not None:
            raise RuntimeError("step_in_backward is already active on this optimizer; remove() its handle first "
                               "(optimizer.in_backward.remove(), where the handle was not kept)")
        _refuse_listed_twice(optimizer.param_groups)
        self.loss_scale = _loss_scale(loss_scale, optimizer)
        """The :class:`~fira_optim.loss_scale.LossScale` (None without loss scaling)."""
        self.optimizer = optimizer
        self.model = model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper of a DDP model
        self._accumulating = False
        self._active = True
        self._hooks: list = []
        self._covered: set = set()  # the parameters whose update a hook runs
        self._updated: set = set()  # those a hook updated since the last optimizer.step()
        self._kept_since: set = set()  # those of _updated whose gradient a later backward kept (accumulate, paused)
        self._warned = False
        self.skip_warned = False  # nonfinite="skip": a skipped update was warned of in this step
        # the optimizer's parameters as of this step (_own), for the hooks: one set a step, not one
        # a hook (291 hooks at 7B built 291 sets, 5 ms a step); groups change between steps
        self._own_in_step: set | None = None
        # Under DDP: micro-batches accumulated (no_sync) since the last synchronised backward
        self._unsynced = False
        self._ddp = _is_ddp(model)
        if self._ddp and optimizer.split_refresh:
            # its gathers and broadcasts would run inside DDP's communication hook, between the
            # bucket all-reduces, in an order the ranks need not share: they hung at the first refresh
            raise ValueError("step_in_backward under DDP cannot share the refresh SVDs: the optimizer has "
                             "split_refresh=True; build it with split_refresh=False (each rank then computes "
                             "its own bases, the same ones, from the same all-reduced gradients)")
        if self._ddp:
            own = self._own()
            reduced = [p for p in _ddp_reduced(model) if p in own]  # not another optimizer's weights
            self._target = _ddp_dispatch(model)
            other = self._target[0]
            if other is not None and other._active:
                # one communication hook per wrapper: taken over, the other handle's weights would
                # no longer be updated at all
                raise ValueError(
                    f"step_in_backward: this DDP model's updates in the backward pass already run for "
                    f"another {type(other.optimizer).__name__} (one handle per DDP model); remove() that "
                    "handle first, or give one optimizer all the weights")
            _claim(self, reduced)
            self._target[0] = self
            self._covered.update(reduced)
            if self.loss_scale is not None:  # the hook sees only synchronised passes: check each one here
                self._hooks.extend(p.register_post_accumulate_grad_hook(self._check_scaled) for p in reduced)
        else:
            self.cover([p for group in optimizer.param_groups for p in group["params"]])
        optimizer._in_backward = self
        if self.loss_scale is not None:  # last: a handle refused above must not hold the scale
            self.loss_scale.handle = self

    def _own(self) -> set:
        """The optimizer's parameters (a group added since included)."""
        return {p for group in self.optimizer.param_groups for p in group["params"]}

    def cover(self, params) -> None:
        """Hook those of ``params`` that require a gradient and have no hook yet (outside DDP,
        whose communication hook covers the parameters it reduces: it marks them as it runs)."""
        self._own_in_step = None  # a group added (add_param_group) or weights unfrozen
        params = list(params)
        if len(set(params)) != len(params):  # a group added that lists a tensor twice
            _refuse_listed_twice(self.optimizer.param_groups)
        if self._ddp or not self._active:
            return
        new = [p for p in params if p.requires_grad and p not in self._covered]
        _claim(self, new)
        for p in new:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
            self._covered.add(p)

    def uncovered(self) -> list:
        """The parameters ``optimizer.step()`` updates (nothing while :meth:`accumulate` is
        entered, as for the hooked ones): those of the optimizer that have a gradient no hook
        took, frozen when the hooks were registered and unfrozen since, or, under DDP, not reduced
        by DDP (not in the model, or frozen when DDP was built); and those whose gradient was
        accumulated under :meth:`accumulate` and never updated by a later backward (a final
        micro-batch run inside it: the step then updates them as a plain step would). RuntimeError
        where a gradient that a hook used and freed in this step is back without a backward pass
        inside :meth:`accumulate` or :meth:`paused` (DDP's reducer writes its averaged gradients back after the
        backward pass: the hooks have updated from this rank's own ones)."""
        if self._accumulating:
            return []
        if not self._ddp:
            self._refuse_written_back()
        # Outside DDP a hook frees the gradient it used, so a gradient still there is one no hook
        # took; DDP's communication hook puts the local gradients back after its update.
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None and not (self._ddp and p in self._covered)]

    def _refuse_written_back(self) -> None:
        if not self._updated:
            return
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and p in self._updated and p not in self._kept_since:
                    model = "None" if self.model is None else f"a {type(self.model).__name__}"
                    raise RuntimeError(
                        f"step_in_backward: {param_name(gi, pi, p, group)} has a gradient at optimizer.step() "
                        "after its update in this step's backward pass had freed it: something wrote it back "
                        "after the backward pass, as DistributedDataParallel does with its averaged gradients, so "
                        "each rank updated from its own gradients and the ranks have diverged. Under DDP pass "
                        f"the DDP-wrapped model itself, step_in_backward(optimizer, ddp_model) (got model={model}), "
                        "and start again from the last checkpoint")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (``loss_scale=``): call ``.backward()`` on this. Each
        update divides its gradients by the scale first."""
        if self.loss_scale is None:
            raise RuntimeError("this handle has no loss scale: pass loss_scale='dynamic' (or a number) to "
                               "step_in_backward for fp16 autocast, and call backward() on the loss itself "
                               "otherwise")
        return self.loss_scale.scale(loss)

    @contextlib.contextmanager
    def scaled_backward(self) -> Iterator[None]:
        """Around a backward pass whose gradients already carry the loss scale without starting
        from :meth:`scale`'s tensor (``hidden.backward(hidden_detached.grad)``, a pipeline
        stage): such a pass is otherwise refused as unscaled
        (:meth:`~fira_optim.loss_scale.LossScale.scaled_backward`)."""
        if self.loss_scale is None:
            raise RuntimeError("this handle has no loss scale: scaled_backward() is for step_in_backward(..., "
                               "loss_scale=...)")
        with self.loss_scale.scaled_backward():
            yield

    def unscaled(self, params) -> list:
        """Divide the gradients of ``params`` by the loss scale (none: nothing to do); those of
        ``params`` to update: all without a loss scale, else those with a gradient that did not
        overflow (each overflow skips its own parameter's update, and the scale backs off at the
        next ``optimizer.step()``)."""
        params = list(params)
        if self.loss_scale is None:
            return params
        with_grad = [p for p in params if p.grad is not None]
        finite = self.loss_scale.unscale_([p.grad for p in with_grad])
        return [p for p, ok in zip(with_grad, finite) if ok]

    def stepped(self) -> None:
        """``optimizer.step()`` ran: the updates since the last one were one step's (and the
        loss scale moves, once per step)."""
        if self._unsynced and not self._accumulating:
            # Every micro-batch of the step ran inside accumulate(): under no_sync nothing was
            # all-reduced, so no communication hook updated, and step() has no averaged gradients
            # to update from (outside DDP it updates what accumulated)
            self._unsynced = False
            warnings.warn(
                "step_in_backward under DDP: optimizer.step() follows backward passes that all ran inside "
                "handle.accumulate(), so nothing was updated in this step (the communication hook updates "
                "nothing inside it); run each step's final micro-batch, its forward and backward passes, "
                "outside accumulate()", UserWarning, stacklevel=3)
        self._updated.clear()
        self._kept_since.clear()
        self.skip_warned = False
        self._own_in_step = None
        if self.loss_scale is not None:
            self.loss_scale.update()

    def _updating(self, params) -> None:
        # A second update of a parameter before step(): an accumulation loop that does not enter
        # accumulate() (every micro-batch then updates, and the scheduler counts a fraction of them)
        if not self._warned and not self._updated.isdisjoint(params):
            self._warned = True
            warnings.warn(
                "step_in_backward: a backward pass updated parameters that an earlier one had updated "
                "since the last optimizer.step(): every backward outside handle.accumulate() is a whole "
                "update. To accumulate gradients, run the backward passes of the non-final micro-batches "
                "inside `with handle.accumulate():` (a Trainer's gradient_accumulation_steps does not), "
                "and call optimizer.step() once per update. (A gradient completed twice in one backward, "
                "as reentrant activation checkpointing does to a weight used twice, also updates twice: "
                "use use_reentrant=False)", UserWarning, stacklevel=2)
        self._updated.update(params)

    def updated_besides(self, p: torch.Tensor) -> int:
        """How many parameters other than ``p`` were updated in the backward pass since the last
        ``optimizer.step()`` (a non-finite gradient's error says they keep their update)."""
        return len(self._updated - {p})

    def _update(self, params: set) -> None:
        """Update ``params`` now, from their gradients (a hook's or DDP's call)."""
        self._updating(params)
        kept = self.unscaled(params)  # under loss scaling, those whose gradient did not overflow
        if not kept:
            return
        try:
            self.optimizer._step_params(set(kept))
        except BaseException:
            # The backward is abandoned (a non-finite gradient raised): a caller that recovers
            # and trains on runs no accumulation loop
            self._updated.clear()
            raise

    def _hook(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        paused = self.optimizer._in_backward is not self
        if paused or self._accumulating:
            if p in self._updated:  # a gradient kept by a backward after the update: not a writer's
                self._kept_since.add(p)
            if paused:
                return
        if self.loss_scale is not None:  # each backward pass, also one that accumulates
            self.loss_scale.check_backward()
        if self._accumulating:
            return
        if self._own_in_step is None:
            self._own_in_step = self._own()
        if p not in self._own_in_step:
            # removed from its group since it was hooked (given to another optimizer, say): a plain
            # step() would leave it and its gradient alone, so the hook does too
            return
        self._update({p})
        p.grad = None

    def _check_scaled(self, p: torch.Tensor) -> None:
        """Under DDP with a loss scale: the check of :meth:`_hook`, for every backward pass (the
        communication hook runs for the synchronised ones only, not under ``no_sync``)."""
        if self._active and self.optimizer._in_backward is self:
            self.loss_scale.check_backward()

    def _ddp_hook(self, state, bucket):  # unannotated: DDP checks the annotations it finds
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        future = default_hooks.allreduce_hook(state, bucket)
        self._unsynced = False  # a synchronised backward (also a paused one): what accumulated is reduced
        if not self._active or self._accumulating or self.optimizer._in_backward is not self:  # or paused
            return future  # the averaged gradients stay for optimizer.step()
        used = _used_anywhere(self.model, state, list(bucket.parameters()))

        def update(done: torch.futures.Future) -> torch.Tensor:
            params = list(bucket.parameters())
            # The model's weights that another optimizer trains (torch's AdamW beside Fira) are left
            # to that optimizer's step, which updates them from the averaged gradients DDP leaves
            own = self._own()
            # updated here, not again by step(): also a parameter frozen when the hooks were
            # registered (DDP reduces what required a gradient when it was built)
            self._covered.update(p for p in params if p in own)
            local = [p.grad for p in params]
            # Unused on every rank (find_unused_parameters=True): its slice of the bucket is zeros, and
            # DDP leaves its .grad None, so optimizer.step() would not update it; nor is it updated here
            kept = params if used is None else [p for p, flag in zip(params, used.wait()) if flag]
            kept = [p for p in kept if p in own]
            for p, grad in zip(params, bucket.gradients()):
                p.grad = grad  # the averaged gradient, a view of the reduced bucket
            try:
                if kept:
                    self._update(set(kept))
            finally:  # DDP then finishes its own bookkeeping of .grad as usual
                for p, grad in zip(params, local):
                    p.grad = grad
            return done.value()[0]

        return future.then(update)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Training as without the handle inside the block: a backward pass updates nothing and
        keeps the gradients (under DDP the averaged ones), and ``optimizer.step()`` updates every
        parameter with a gradient, with no loss scale, the scale not moved. For code that steps the
        optimizer outside training: ``torch.distributed.checkpoint``'s ``get_state_dict`` / ``set_state_dict``
        build an optimizer's missing state by a step on zero gradients at lr 0, which would
        otherwise update nothing under DDP (the state then loads nowhere: the moments restart
        from zero) and find the gradients unscaled under a loss scale."""
        if self.optimizer._in_backward is not self:
            raise RuntimeError("paused() needs the handle that is active on its optimizer (this one was removed, "
                               "or replaced)")
        self.optimizer._in_backward = None
        try:
            yield
        finally:  # back, unless removed inside the block (or another handle was made there)
            if self._active and self.optimizer._in_backward is None:
                self.optimizer._in_backward = self

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Around the backward passes of the non-final micro-batches of a step: gradients
        accumulate and nothing is updated (under DDP also ``no_sync``; under FSDP2 each
        micro-batch is still reduce-scattered, into the sharded gradients, which is what FSDP2
        accumulates at the least memory)."""
        previous = self._accumulating
        self._accumulating = True
        with contextlib.ExitStack() as stack:
            if self._ddp:
                stack.enter_context(self.model.no_sync())
            try:
                yield
            finally:
                self._accumulating = previous
                self._unsynced = self._ddp

    def remove(self) -> None:
        """Back to updates in ``optimizer.step()``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._covered.clear()
        self._active = False
        _ACTIVE.discard(self)
        if self.loss_scale is not None and self.loss_scale.handle is self:  # free for another handle
            self.loss_scale.handle = None
        if self._ddp and self._target[0] is self:  # DDP's hook all-reduces only, until another handle
            self._target[0] = None
        if self.optimizer._in_backward is self:
            self.optimizer._in_backward = None


def step_in_backward(optimizer: "Fira", model: Any = None, *, loss_scale: Any = None) -> StepInBackward:
    """Update every parameter of ``optimizer`` inside the backward pass, as soon as its gradient
    is complete, and free the gradient (module docstring). ``model``: the DDP-wrapped model under
    DDP (required there; also as ``torch.compile`` returns it); anything else is ignored. ``loss_scale``: for fp16 autocast, ``"dynamic"``
    (GradScaler's defaults), a number (a static scale) or a
    :class:`~fira_optim.loss_scale.LossScale`; then ``handle.scale(loss).backward()``.
    Returns the handle; ``handle.remove()`` restores the normal behaviour."""
    from .optimizer import Fira

    if not isinstance(optimizer, Fira):
        raise TypeError(f"step_in_backward takes a fira_optim.Fira optimizer, got "
                        f"{type(optimizer).__name__}")
    if optimizer._optimizer_step_pre_hooks:
        warnings.warn(f"step_in_backward: the optimizer has {len(optimizer._optimizer_step_pre_hooks)} step "
                      "pre-hook(s); they run at optimizer.step(), after the updates done in the backward pass, "
                      "so what they change of the gradients or the learning rate reaches the next step's "
                      "updates at the earliest", UserWarning, stacklevel=2)
    return StepInBackward(optimizer, model, loss_scale)


def _loss_scale(value: Any, optimizer: "Fira") -> LossScale | None:
    """``loss_scale=`` as a :class:`LossScale` (None: no scaling); ValueError naming the value."""
    if value is None:
        return None
    if isinstance(value, LossScale):
        if value.handle is not None and value.handle._active:
            raise ValueError("loss_scale: this LossScale is used by another step_in_backward handle (each would "
                             "move it once per step); give each handle its own, or remove() the other first")
        scale = value
    elif value == "dynamic":
        scale = LossScale()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        check_scale("loss_scale", value)  # named as given (LossScale would name its init_scale)
        scale = LossScale(init_scale=value, dynamic=False)
    else:
        raise ValueError(f"loss_scale must be None, 'dynamic', a number (a static scale, in float32's range) "
                         f"or a fira_optim.LossScale, got loss_scale={value!r}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.dtype == torch.float16 for p in params):
        raise ValueError(_FP16_GRADIENTS)
    if any(distributed.is_dtensor(p) for p in params):
        # each rank would see its own shard overflow and skip its own rows of a matrix's update
        raise ValueError("loss_scale does not run on sharded (FSDP2) parameters: each rank finds overflows "
                         "in its own shard only; use bf16 autocast there, which needs no scaling")
    return scale


def _refuse_listed_twice(groups: list[dict]) -> None:
    """ValueError naming both places of a tensor that ``groups`` list twice (a weight tied to
    another, as an embedding to its head, listed once for each module): ``optimizer.step()``
    updates it once for each place, as torch's optimizers do, where the backward pass completes
    its gradient, so updates it, once."""
    seen: dict = {}
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if p in seen:
                first = param_name(*seen[p], p, groups[seen[p][0]])
                raise ValueError(
                    f"step_in_backward: {param_name(gi, pi, p, group)} is the same tensor as {first} (a weight "
                    "tied to another, listed for each module): optimizer.step() updates it once for each place it "
                    "is listed, the backward pass once; list it once (model.parameters() does)")
            seen[p] = (gi, pi)


#: The handles not removed: a second one over a parameter that one of them updates (another
#: optimizer over the same weights, a second Trainer on the same model) would update it twice.
_ACTIVE: "weakref.WeakSet[StepInBackward]" = weakref.WeakSet()
_ACTIVE_LOCK = threading.Lock()  # handles made from two threads at once


def _claim(handle: StepInBackward, params: list) -> None:
    """Count ``handle`` among the active ones; ValueError if another one updates one of ``params``
    (which ``handle`` then adds to the parameters it covers)."""
    with _ACTIVE_LOCK:
        for other in list(_ACTIVE):
            if other is not handle and other._active and not other._covered.isdisjoint(params):
                shape = next(tuple(p.shape) for p in params if p in other._covered)
                raise ValueError(
                    f"step_in_backward: a parameter of shape {shape} is already updated in the backward "
                    f"pass by the handle of another {type(other.optimizer).__name__} (a step_in_backward() "
                    "call not undone, or a FiraTrainer's while it trains): each backward would update it "
                    "twice; remove() that handle first (that optimizer's in_backward.remove(), where the handle "
                    "was not kept)")
        _ACTIVE.add(handle)


def _ddp_dispatch(model: Any) -> list:
    """The one-element list whose handle (or None) DDP's communication hook of ``model`` runs:
    registered once per wrapper (DDP cannot register a second hook, nor remove one), so a handle
    made after another's ``remove()`` on the same wrapper (a second ``Trainer.train()``) takes it
    over; with None it all-reduces only, as DDP's default."""
    target = model.__dict__.get("_fira_in_backward")
    if target is None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        target = [None]

        def hook(state, bucket):  # unannotated: DDP checks the annotations it finds
            handle = target[0]
            return default_hooks.allreduce_hook(state, bucket) if handle is None else handle._ddp_hook(state, bucket)

        model.register_comm_hook(state=None, hook=hook)
        model.__dict__["_fira_in_backward"] = target
    return target


class _UsedFlags:
    """Which parameters of a bucket some rank used (an all-reduce of each rank's flags, started
    beside the bucket's)."""

    def __init__(self, flags: torch.Tensor, work: Any) -> None:
        self._flags, self._work = flags, work

    def wait(self) -> list[bool]:
        self._work.wait()
        return [flag > 0 for flag in self._flags.tolist()]


def _used_anywhere(model: Any, process_group: Any, params: list) -> _UsedFlags | None:
    """Under ``find_unused_parameters=True`` or ``static_graph=True`` (where DDP also reduces a
    weight the forward pass did not use, as zeros, and leaves its gradient None), an all-reduce
    (MAX) of whether each of ``params`` has a gradient on this rank (it was used in this
    backward); None where DDP reduces only used parameters (its default), so every one of them is."""
    if not (getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", False)):
        return None
    import torch.distributed as dist

    device = params[0].device if params else torch.device("cpu")
    flags = torch.tensor([float(p.grad is not None) for p in params], device=device)
    return _UsedFlags(flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group, async_op=True))


def _ddp_reduced(model: Any) -> list:
    """The parameters DDP all-reduces: those that required a gradient when it was built, read off
    its buckets (a weight frozen then and unfrozen since is not reduced: ``optimizer.step()``
    updates it; taken as reduced, nothing did). A torch without that accessor: those that require
    a gradient now."""
    buckets = getattr(getattr(model, "reducer", None), "_get_zeros_like_grad_buckets", None)
    if buckets is None:
        return [p for p in model.parameters() if p.requires_grad]
    seen: dict = {}
    for bucket in buckets():
        for p in bucket.parameters():
            seen.setdefault(id(p), p)
    by_id = {id(p): p for p in model.parameters()}  # the model's own tensors, in its order
    return [by_id[i] for i in by_id if i in seen]


def _is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)
