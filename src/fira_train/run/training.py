"""What a run trains, built from its config: model -> [parallelize] -> method -> schedule
(:func:`build_training`), on the device and at the precision the config asks for."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import fira_optim
from fira_train.config.run_config import RunConfig
from fira_train.methods.method import MethodSetup
from fira_train.methods.model import build_model
from fira_train.methods.registry import build_method, get_method
from fira_train.run.parallel import DistributedEnv, parallelize, unwrap
from fira_train.run.schedule import WarmupCosine


@dataclass
class Training:
    """Everything the loop mutates, built by :func:`build_training`."""

    setup: MethodSetup
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    parallel_model: torch.nn.Module | None = None
    """The DDP wrapper that runs the forward passes (None otherwise: FSDP2 shards the model in
    place, and ``model`` is then the FSDP2 module)."""
    in_backward: fira_optim.StepInBackward | None = None
    """The handle of ``optim.step_in_backward``: updates run inside the backward pass."""
    grad_scaler: torch.amp.GradScaler | None = None
    """``train.precision=fp16`` with a plain step: the loss scaling (with step-in-backward the
    handle scales, ``in_backward.loss_scale``)."""
    skipped_steps: int = 0
    """Steps skipped in this process for a gradient overflow (``grad_scaler``)."""

    @property
    def loss_scaler(self) -> torch.amp.GradScaler | fira_optim.LossScale | None:
        """The loss scaling of ``train.precision=fp16``: ``grad_scaler``, or the step-in-backward
        handle's :class:`fira_optim.LossScale` (None: none). Both scale, report and checkpoint
        alike (``scale``, ``get_scale``, ``state_dict``, ``load_state_dict``)."""
        if self.grad_scaler is not None:
            return self.grad_scaler
        return self.in_backward.loss_scale if self.in_backward is not None else None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (as it is without one)."""
        scaler = self.loss_scaler
        return loss if scaler is None else scaler.scale(loss)

    def loss_scale_value(self) -> float | None:
        """The loss scale now (None without loss scaling)."""
        scaler = self.loss_scaler
        return None if scaler is None else scaler.get_scale()

    def skipped_updates(self) -> int:
        """Parameter updates the step-in-backward handle's loss scale skipped for an overflow
        over the run (its state holds the count; 0 without one): there an overflow skips its own
        matrices, not the step."""
        scaler = self.loss_scaler
        return scaler.skipped if isinstance(scaler, fira_optim.LossScale) else 0

    def loss_scale_state(self) -> dict | None:
        """The loss scale's state (plain values) for a checkpoint; None without loss scaling."""
        scaler = self.loss_scaler
        return None if scaler is None else scaler.state_dict()

    def load_loss_scale_state(self, state: dict | None) -> None:
        """Take back :meth:`loss_scale_state` (None: a checkpoint without loss scaling)."""
        scaler = self.loss_scaler
        if state is not None and scaler is not None:
            scaler.load_state_dict(state)

    @property
    def model(self) -> torch.nn.Module:
        """The model whose parameters the optimizer holds (checkpointed, seen by callbacks)."""
        return self.setup.model

    @property
    def forward_model(self) -> torch.nn.Module:
        """The module to call for the training and validation forward passes."""
        return self.parallel_model if self.parallel_model is not None else self.setup.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.setup.optimizer


def resolve_device(config: RunConfig) -> torch.device:
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available")
    if config.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.train.device)


def autocast_for(config: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA devices that support it ("auto"), or wherever "bf16" asks for it;
    fp16 autocast for "fp16" (with loss scaling: :class:`Training`)."""
    precision = config.train.precision
    if precision == "fp16":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    if precision == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        use_bf16 = precision == "bf16"
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def warned_on_rank_zero(env: DistributedEnv | None) -> Iterator[None]:
    """Python warnings raised inside given by rank 0 alone under ``train.parallel`` ddp / fsdp2
    (held back on the other ranks). For what reads the config and the model alone, which every
    rank builds alike, or a state every rank holds whole (a checkpoint loaded under DDP): each
    rank would print the same warning, once per process."""
    if env is None or not env.distributed or env.is_main:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build_training(config: RunConfig, vocab_size: int, device: torch.device,
                   env: DistributedEnv | None = None) -> Training:
    """Model (seeded random init) -> [parallelize] -> method (optimizer) -> schedule.

    With ``train.parallel`` ddp / fsdp2 (``env``: the process group's), the model is
    parallelized before the optimizer sees its parameters: FSDP2 replaces them by row-sharded
    DTensors, which the optimizer must hold; under DDP the optimizer holds the wrapped
    module's parameters and Fira-family methods deal their refresh SVDs to the ranks
    (``split_refresh``).
    """
    # pure bf16 weights (and so gradients) are built in bf16 on the host, then moved
    dtype = torch.bfloat16 if config.train.param_dtype == "bfloat16" else torch.float32
    model = build_model(config.model, vocab_size, config.data.seq_len, config.train.seed, dtype).to(device)
    if config.train.activation_checkpointing:
        # transformers 5 renamed it (the old name warns that it goes in v6); 4.x has the old one
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    mode = config.train.parallel
    wrapped = None
    if mode != "none":
        wrapped = parallelize(model, mode, env)
        model = unwrap(wrapped)  # FSDP2: the sharded model itself
    # Under DDP the refresh SVDs are dealt to the ranks, but not from inside DDP's communication
    # hook (where updates in the backward pass run): there each rank computes its own.
    # The optimizer is built from the config and the model alone, the same on every rank: what
    # it warns of (a rank above every matrix's size) rank 0 says for the launch.
    with warned_on_rank_zero(env):
        setup = build_method(model, config, split_refresh=mode == "ddp" and not config.optim.step_in_backward)
        # (a method that does not read it is warned of by the command line: not twice)
        reads = "host_refresh" in get_method(config.optim.method).uses
        if config.optim.host_refresh and device.type == "cpu" and reads:
            warnings.warn("optim.host_refresh=true changes nothing on the CPU: it moves the refresh SVDs of "
                          "an accelerator's gradients to the host, where these already are", UserWarning,
                          stacklevel=2)
    in_backward, grad_scaler = None, None
    fp16 = config.train.precision == "fp16"
    if config.optim.step_in_backward:
        in_backward = fira_optim.step_in_backward(setup.optimizer, wrapped if mode == "ddp" else None,
                                                  loss_scale="dynamic" if fp16 else None)
    elif fp16:
        grad_scaler = torch.amp.GradScaler(device.type)
    schedule = WarmupCosine(config.train.steps, config.train.warmup_fraction, config.train.min_lr_ratio,
                            restart_every=setup.restart_every, rewarmup=setup.rewarmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, schedule)
    return Training(setup, scheduler, device, wrapped if wrapped is not model else None, in_backward, grad_scaler)
