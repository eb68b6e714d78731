r"""Parameters that are not projected: biases, norms, embeddings, ``rank=None`` groups and
matrices with ``rank >= min(m, n)``. Complex parameters (``rank=None`` groups with fp32 states
only) step as real views of their storage, as in torch's optimizers.

With ``arithmetic="paper"`` they are updated by torch's own functional optimizers, so a
``rank=None`` group is *exactly* ``torch.optim.AdamW`` (or ``Adagrad`` / ``RMSprop`` with
decoupled weight decay), with torch's choice of implementation or the one the group's
``foreach`` / ``fused`` options name, as for torch's optimizers. One exception, shared with the
projected matrices (which cannot derive a basis from a zero gradient): until a parameter's first
non-zero gradient, a step with an all-zero gradient only builds its state (no weight decay, no
step count). So the state-building step of ``torch.distributed.checkpoint`` (zero gradients at
lr 0) does not advance the bias correction, where ``torch.optim.AdamW`` counts it; and a
parameter whose gradient stays exactly zero from the start (an unused expert under
``zero_grad(set_to_none=False)``) is not decayed until it gets one.

With ``arithmetic="released"`` they follow ``fira`` 1.0.2 (the Hugging Face AdamW it copies):

.. math::
    p \leftarrow p - \eta \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} \frac{m_t}{\sqrt{v_t} + \epsilon},
    \qquad p \leftarrow p - \eta\lambda p

An fp16 parameter keeps its moments in fp32, and its update is formed in fp32 on a copy and
rounded once: in fp16, :math:`\epsilon = 10^{-8}` and :math:`(1-\beta_2) g^2` of a small
gradient round to 0, so fp16 moments give 0 / 0 wherever a gradient entry is 0 (torch's own
AdamW does that). bf16 has fp32's range: its moments stay bf16, as in ``torch.optim.AdamW``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.optim import adagrad as torch_adagrad
from torch.optim import adam as torch_adam
from torch.optim import rmsprop as torch_rmsprop

from . import distributed, precision
from .options import Arithmetic, Base, StateDtype, StateRounding
from .subspace import STATE_KEYS, adam_bias_correction


def init_state(state: dict, p: torch.Tensor, group: dict) -> None:
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    dtype = torch.float32 if p.dtype == torch.float16 else p.dtype
    kind = StateDtype(group["state_dtype"])
    for key in STATE_KEYS[group["base"]]:
        if kind is StateDtype.FLOAT32:
            state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        else:
            state.update(precision.moment_zeros(tuple(p.shape), kind, dtype, p.device, key, make=(
                lambda shape, dt: torch.zeros_like(p, dtype=dt) if tuple(shape) == tuple(p.shape)
                else torch.zeros(shape, dtype=dt, device=p.device))))


#: Offset of the unprojected parameters' indices in the stochastic-rounding seeds.
_ROUNDING_OFFSET = 1 << 20


def step_groups(groups: list[tuple[dict, list[torch.Tensor]]], states: dict,
                position: Mapping[torch.Tensor, int]) -> None:
    """Update each ``(group, params)`` pair; ``states`` is the optimizer's ``self.state``,
    ``position`` each parameter's index among all groups' parameters, in group order: it seeds
    the parameter's stochastic rounding, so two parameters never share a stream (an index within
    its group did: the first parameter of every group drew the same bits). The first group's
    indices are the same either way.

    A parameter stepped through fp32 copies (low-precision states, fp16, bf16 with stochastic
    rounding) goes :data:`precision.CHUNK` elements at a time if it is larger
    (:func:`_step_in_chunks`), so the copies are a chunk's, not the parameter's. Measured on the
    CPU (peak RSS of one AdamW step minus the RSS before it, fresh process, one thread), a
    32000 x 1024 parameter with int8 states: fp32 63 MiB, was 719; bf16 32 MiB, was 906; fp16
    63 MiB, was 906 (8000 x 1024 fp32: 40 MiB; 64000 x 1024: 71 MiB; the rest is the allocator's
    heap)."""
    for group, given in groups:
        for p in given:
            if not states[p]:
                init_state(states[p], p, group)
        kind = StateDtype(group["state_dtype"])
        rounding, state_rounding = group["stochastic_rounding"], StateRounding(group["state_rounding"])
        # Through fp32 copies: fp16 parameters (module docstring), low-precision states, bf16
        # parameters written by stochastic rounding, and gradients in another dtype than their
        # parameter's (p.grad_dtype: fp32 gradients of bf16 weights), which torch's step refuses.
        copied = [p for p in given if p.dtype == torch.float16 or kind is not StateDtype.FLOAT32
                  or (rounding and p.dtype == torch.bfloat16) or p.grad.dtype != p.dtype]
        if not copied:
            _step(group, given, states)
            continue
        keys = STATE_KEYS[group["base"]]
        chosen = set(copied)
        plain = [p for p in given if p not in chosen]
        if plain:
            _step(group, plain, states)
        # One parameter at a time, and a large one a chunk at a time: only the fp32 copies of
        # one chunk exist at once.
        for p in copied:
            state = states[p]
            order, step = _ROUNDING_OFFSET + position[p], int(state["step"])
            generator = None
            if rounding and p.dtype == torch.bfloat16:
                # a shard (FSDP2's rows, or any other placement) draws its own bits; replicas the same
                generator = precision.rounding_generator(group["seed"], order, step, p.device,
                                                         precision.shard_offset(p))
            moments = precision.state_generators(state_rounding, state, keys, group["seed"], order, step)
            if distributed.to_local(p.detach()).numel() > precision.CHUNK and _chunkable(p, state, keys):
                _step_in_chunks(group, p, state, keys, generator, moments)
                continue
            work_dtype = torch.promote_types(p.dtype, torch.float32)  # fp64 stays fp64
            work = p.detach().to(work_dtype)  # an fp32 (fp64) parameter: a view of it, updated in place
            work.grad = p.grad.to(work_dtype)
            working = precision.decode(state, keys, work_dtype)
            _step(group, [work], {work: working})
            precision.encode(state, working, keys, moments)
            state["step"] = working["step"]
            # Written back where work is a copy. Compared on the local blocks: a DTensor's own
            # data_ptr() is 0, so FSDP2's copies were never written back (no update at all).
            local, local_work = distributed.to_local(p.detach()), distributed.to_local(work)
            if local_work.data_ptr() != local.data_ptr():
                precision.round_into(local, local_work, generator)


def _chunkable(p: torch.Tensor, state: dict, keys) -> bool:
    """Whether the blocks this process holds of ``p``, its gradient and its moments (the tensors
    themselves, or a DTensor's local tensor: FSDP2's rows) are plain contiguous tensors of one
    size, so that a chunk of each is a slice of its memory."""
    tensors = [distributed.to_local(t) for t in [p.detach(), p.grad] + [state[key] for key in keys]]
    return all(type(t) is torch.Tensor and t.is_contiguous() for t in tensors) and \
        len({t.numel() for t in tensors}) == 1


def _step_in_chunks(group: dict, p: torch.Tensor, state: dict, keys, generator, moments=None) -> None:
    """The step of ``p`` through fp32 copies, :data:`precision.CHUNK` elements at a time (whole
    quantization blocks): the parameter, gradient and moments of a chunk are decoded to fp32,
    stepped, and encoded back before the next one. The step functions are elementwise, the
    quantization is per block, and stochastic rounding draws its random bits in order, 16 per
    element, from one generator (``generator`` the parameter's, ``moments`` each bf16 moment's:
    :func:`fira_optim.precision.state_generators`; :func:`fira_optim.precision.uniform_bits16`,
    and the chunks are multiples of 4 elements), so on the CPU the result is bit for bit the
    unchunked one (on CUDA, Philox's offset advances per call, so the bits may depend on the
    fixed chunk size; a resumed run still draws the same ones). Each chunk steps with a copy of
    the step counter, which is set once, at the end."""
    size = precision.CHUNK
    if size % precision.BLOCK:
        raise ValueError(f"precision.CHUNK ({size}) must be a multiple of precision.BLOCK")
    # under FSDP2, this rank's blocks (the generators already carry their offsets)
    flat, grad, counter = distributed.to_local(p.detach()).view(-1), distributed.to_local(p.grad).view(-1), state["step"]
    state = {key: distributed.to_local(value) if torch.is_tensor(value) else value for key, value in state.items()}
    work_dtype = torch.promote_types(p.dtype, torch.float32)  # fp64 stays fp64
    stepped = counter
    for start in range(0, flat.numel(), size):
        stop = min(start + size, flat.numel())
        part = flat[start:stop]
        work = part.to(work_dtype)  # an fp32 (fp64) parameter: a view of it, updated in place
        work.grad = grad[start:stop].to(work_dtype)
        working = precision.decode_slice(state, keys, work_dtype, start, stop)
        working["step"] = stepped = counter.clone()
        _step(group, [work], {work: working})
        precision.encode_slice(state, working, keys, start, stop, moments)
        if work.data_ptr() != part.data_ptr():
            precision.round_into(part, work, generator)
    counter.copy_(stepped)


def _step(group: dict, params: list[torch.Tensor], states: dict) -> None:
    params, states = _real_views(params, states)
    if Arithmetic(group["arithmetic"]) is Arithmetic.RELEASED:
        _released_adamw(group, params, states)
    elif Base(group["base"]) is Base.ADAM:
        _torch_adamw(group, params, states)
    else:
        _torch_adagrad_or_rmsprop(group, params, states)


def _real_views(params: list[torch.Tensor], states: dict) -> tuple[list[torch.Tensor], dict]:
    """Complex parameters as real ``(..., 2)`` views of their storage, with their gradients and
    moments viewed the same way: each real and imaginary part steps as a real parameter of its
    own, as in ``torch.optim.AdamW``. Real parameters pass unchanged."""
    if not any(p.is_complex() for p in params):
        return params, states
    views, view_states = [], {}
    for p in params:
        if p.is_complex():
            view = torch.view_as_real(p.detach())  # shares p's storage: updated in place
            view.grad = torch.view_as_real(p.grad)
            view_states[view] = {key: torch.view_as_real(v) if torch.is_tensor(v) and v.is_complex() else v
                                 for key, v in states[p].items()}  # the step counter: the same tensor
            p = view
        else:
            view_states[p] = states[p]
        views.append(p)
    return views, view_states


def _torch_adamw(group: dict, params: list[torch.Tensor], states: dict) -> None:
    beta1, beta2 = group["betas"]
    steps = [states[p]["step"] for p in params]
    fused_on_device = bool(group.get("fused")) and bool(params) and params[0].device.type != "cpu"
    counted = steps
    if fused_on_device:
        # torch's fused kernel reads each step count through a device pointer (torch.optim.AdamW
        # keeps them on the device under fused=True); this optimizer keeps them on the host,
        # where its step plan reads them without a device sync. The kernel gets device copies
        # (one copy for the group), which it counts, and the host counts are advanced alongside.
        values = torch.tensor([float(s) for s in steps], dtype=torch.float32)
        counted = list(values.to(params[0].device, non_blocking=True).unbind())
    torch_adam.adam(
        params,
        [p.grad for p in params],
        [states[p]["exp_avg"] for p in params],
        [states[p]["exp_avg_sq"] for p in params],
        [],
        counted,
        foreach=group.get("foreach"),
        fused=group.get("fused"),
        has_complex=False,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
    if fused_on_device:
        for step in steps:
            step.add_(1)


def _lr(group: dict) -> float:
    # A one-element Tensor lr (validate_group) of any shape: torch's foreach scalars and
    # ``alpha=`` take numbers only.
    return float(group["lr"])


def _torch_adagrad_or_rmsprop(group: dict, params: list[torch.Tensor], states: dict) -> None:
    lr = _lr(group)
    if group["weight_decay"] != 0:  # decoupled, as for the projected matrices
        torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
    grads = [p.grad for p in params]
    steps = [states[p]["step"] for p in params]
    if Base(group["base"]) is Base.ADAGRAD:
        torch_adagrad.adagrad(
            params, grads, [states[p]["sum"] for p in params], steps, foreach=group.get("foreach"),
            lr=lr, weight_decay=0.0, lr_decay=0.0, eps=group["eps"], maximize=False,
        )
    else:
        torch_rmsprop.rmsprop(
            params, grads, [states[p]["square_avg"] for p in params], [], [], steps,
            foreach=group.get("foreach"),
            lr=lr, alpha=group["betas"][1], eps=group["eps"], weight_decay=0.0,
            momentum=0.0, centered=False,
        )


def _released_adamw(group: dict, params: list[torch.Tensor], states: dict) -> None:
    beta1, beta2 = group["betas"]
    lr = _lr(group)
    for p in params:
        state = states[p]
        state["step"] += 1
        step = int(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
        step_size = lr
        if group["correct_bias"]:
            step_size *= adam_bias_correction(step, beta1, beta2)
        p.add_(exp_avg / exp_avg_sq.sqrt().add_(group["eps"]), alpha=-step_size)
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-lr * group["weight_decay"])
