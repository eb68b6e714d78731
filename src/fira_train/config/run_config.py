"""Run configuration: nested dataclasses, validated on construction, overridable as ``key=value``.

A run is described by one :class:`RunConfig` holding four sections:

- ``model`` (:class:`ModelConfig`): the LLaMA architecture (``transformers.LlamaConfig`` names);
- ``optim`` (:class:`OptimConfig`): the method (a name from :mod:`fira_train.methods.registry`)
  and its hyper-parameters (learning rate, rank, subspace update gap T, alpha, ...);
- ``data`` (:class:`fira_train.data.spec.DataSpec`): corpus, tokenizer, sequence length;
- ``train`` (:class:`TrainConfig`): steps, batch, schedule, evaluation, checkpoints, output.

Every field carries a docstring and every section checks its values in ``__post_init__``,
raising ``ValueError`` with the field's name and the offending value. ``section.field=value``
overrides and the ``config.json`` round trip are in :mod:`fira_train.config.overrides`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fira_optim import VARIANTS
from fira_optim.options import check_options
from fira_train.data.spec import DataSpec
from fira_train.methods.registry import METHODS

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
PARAM_DTYPES = ("float32", "bfloat16")
#: ``train.parallel``: one process, or a data parallelism of
#: :func:`fira_train.run.parallel.parallelize`.
PARALLEL_MODES = ("none", "ddp", "fsdp2")


#: The largest seed: numpy's ``random.seed`` takes ``[0, 2**32 - 1]``.
MAX_SEED = 2**32 - 1

#: The most torch threads ``train.num_threads`` may ask for. ``torch.set_num_threads`` takes any
#: positive count, but the first parallel kernel then starts that many OpenMP threads, and a count
#: the process cannot start (100000: past ``ulimit -u``, or the memory for their stacks) crashes
#: the interpreter (a segmentation fault, no message). A fixed cap, not one from this machine's
#: ``os.cpu_count()``: a run's config.json is read back on other machines. 1024 is above the
#: logical CPUs of today's largest two-socket servers (768), and more threads than CPUs only
#: oversubscribe them.
MAX_THREADS = 1024

#: The longest ``train.dist_timeout_s`` (about 31 years): a finite number, which config.json
#: records as a number (an infinity would be written as null) and ``datetime.timedelta`` holds.
MAX_DIST_TIMEOUT_S = 10**9


def _check(condition: bool, name: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class ModelConfig:
    """A LLaMA decoder (RMSNorm, SwiGLU, rotary positions), in ``transformers.LlamaConfig`` terms.

    The vocabulary size comes from the tokenizer and the context length from ``data.seq_len``.
    """

    hidden_size: int = 256
    """Width d_model of the residual stream."""
    intermediate_size: int = 688
    """Width of the SwiGLU MLP (LLaMA uses about 8/3 * hidden_size)."""
    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_hidden_layers: int = 4
    """Transformer blocks."""
    num_key_value_heads: int | None = None
    """Key/value heads for grouped-query attention; None means one per attention head."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head (the paper's models do not)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"model.{name}", value, "an integer >= 1")
        _check(
            self.hidden_size % self.num_attention_heads == 0,
            "model.num_attention_heads", self.num_attention_heads,
            f"a divisor of model.hidden_size={self.hidden_size}",
        )
        if self.num_key_value_heads is not None:
            value = self.num_key_value_heads
            _check(
                _is_int(value) and value >= 1 and self.num_attention_heads % value == 0,
                "model.num_key_value_heads", value,
                f"None or a divisor of model.num_attention_heads={self.num_attention_heads}",
            )
        # transformers' LlamaConfig refuses a standard deviation above 1 (with a traceback, when the
        # model is built after the run folder is made): refused here, with the key
        _check(_is_number(self.initializer_range) and 0 < self.initializer_range <= 1,
               "model.initializer_range", self.initializer_range, "a number in (0, 1]")
        _check(_is_number(self.rope_theta) and self.rope_theta > 0,
               "model.rope_theta", self.rope_theta, "a positive number")
        _check(isinstance(self.tie_word_embeddings, bool),
               "model.tie_word_embeddings", self.tie_word_embeddings, "a bool")


@dataclass
class OptimConfig:
    """The training method and its hyper-parameters (see :mod:`fira_train.methods.registry`)."""

    method: str = "fira"
    """A name from the method registry (``fira-train pretrain --help`` lists them)."""
    lr: float | None = None
    """Peak learning rate; None takes the recipe's tuned rate for the method where it has one
    (``tiny``: :data:`fira_train.config.recipes.TUNED_LR`), else the method's default (0.01 for
    Fira/GaLore, 0.001 for AdamW, ...; ``fira-train methods`` lists both)."""
    rank: int = 128
    """Rank r of the projected subspace (Fira/GaLore family) or of the LoRA adapters (lora/relora)."""
    update_proj_gap: int = 200
    """Subspace update frequency T: the projection is recomputed every T optimizer steps."""
    alpha: float = 0.25
    """Fira/GaLore scale factor alpha (0.25 below 1B, 0.0625 from 1B in the paper)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (0 in the paper's pre-training runs)."""
    gamma: float = 1.01
    """Fira's norm-growth limiter threshold gamma (the paper's 1.01)."""
    projector: str = "svd"
    """How the Fira/GaLore family finds its subspace: "svd" (exact, the paper), "randomized"
    (warm-started subspace iteration) or "random" (a variant's own projector wins)."""
    implementation: str = "fast"
    """The Fira/GaLore optimizer's code path: "fast", "compiled" (torch.compile) or "reference"."""
    host_refresh: bool = False
    """On a GPU, compute the Fira/GaLore refresh SVDs on the host CPU (FiraAdamW's
    ``host_refresh``; no effect on the CPU)."""
    step_in_backward: bool = False
    """Fira/GaLore family: update each matrix inside the backward pass as soon as its gradient is
    complete, and free the gradient (``fira_optim.step_in_backward``): the model's full
    gradients never coexist. Not with ``train.grad_clip`` (global-norm clipping needs every
    gradient at once; Fira's norm-growth limiter bounds each matrix's update instead)."""
    state_dtype: str = "float32"
    """Fira/GaLore family: how optimizer states are stored, "float32", "bfloat16" or "int8"
    (block-wise 8-bit; needs torchao). The arithmetic stays fp32."""
    state_rounding: str = "nearest"
    """Fira/GaLore family: how the moments are written into bf16 states
    (``optim.state_dtype=bfloat16``), "nearest" or "stochastic" (FiraAdamW's ``state_rounding``).
    A config saved before the option existed reads as "nearest", what it ran."""
    stochastic_rounding: bool = False
    """Fira/GaLore family: write the updates of bf16 weights (``train.param_dtype=bfloat16``) by
    stochastic rounding."""
    align_signs: bool | None = None
    """Fira/GaLore family: orient each new exact-SVD basis vector along the previous basis
    (FiraAdamW's ``align_signs``, not in the paper's Algorithm 1); None is the variant's setting
    (off: the raw SVD signs, for every variant). A run records the resolved value in its
    ``config.json``; a saved config without it (written while aligning was the default) reads as
    ``true`` for the variants that did not fix it (:func:`fira_train.config.resolve.saved_config`)."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: adapters are scaled by lora_alpha / rank (lora, relora)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch (lora, relora)."""
    relora_every: int | None = None
    """ReLoRA: merge the adapters into the weights and restart them every this many steps;
    None means a quarter of the run (four cycles, as in the ReLoRA paper's 20K/5K)."""
    relora_prune: float = 0.99
    """ReLoRA: fraction of the adapters' Adam moments zeroed (smallest magnitudes) at a restart;
    1.0 resets them completely."""
    relora_rewarmup: int | None = None
    """ReLoRA: steps of linear learning-rate re-warm-up after each restart; None means 2% of a
    cycle (ReLoRA's 100 steps per 5000), but at least 10 steps or a quarter of a cycle, whichever
    is less (2% of a short cycle is one step, no ramp at all)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.method, str) and self.method != "", "optim.method", self.method,
               "a method name")
        if self.lr is not None:
            _check(_is_number(self.lr) and self.lr > 0, "optim.lr", self.lr, "None or a positive number")
        # The optimizer's own options: checked by fira_optim's constructor rules, not copies of them.
        for name in ("rank", "update_proj_gap", "alpha", "betas", "eps", "weight_decay", "gamma",
                     "projector", "implementation", "host_refresh", "stochastic_rounding", "state_dtype",
                     "state_rounding", *(("lr",) if self.lr is not None else ())):  # None: the method's default
            value = getattr(self, name)
            if name == "state_rounding" and self.method in METHODS and name not in METHODS[self.method].uses:
                continue  # refused with the method (RunConfig): not sent to set state_dtype, refused next
            # stochastic rounding is of bf16 states: state_rounding is checked with its state_dtype
            together = {"state_dtype": self.state_dtype} if name == "state_rounding" else {}
            try:
                check_options(**{name: value}, **together)
            except (TypeError, ValueError) as err:
                raise ValueError(f"optim.{name}={value!r} is invalid: {err}") from None
        for name in ("step_in_backward",):
            _check(isinstance(getattr(self, name), bool), f"optim.{name}", getattr(self, name),
                   "true or false")
        _check(self.align_signs is None or isinstance(self.align_signs, bool), "optim.align_signs",
               self.align_signs, "None, true or false")
        _check(_is_number(self.lora_alpha) and self.lora_alpha > 0,
               "optim.lora_alpha", self.lora_alpha, "a positive number")
        _check(_is_number(self.lora_dropout) and 0 <= self.lora_dropout < 1,
               "optim.lora_dropout", self.lora_dropout, "a number in [0, 1)")
        for name in ("relora_every", "relora_rewarmup"):
            value = getattr(self, name)
            if value is not None:
                _check(_is_int(value) and value >= 1, f"optim.{name}", value, "None or an integer >= 1")
        _check(_is_number(self.relora_prune) and 0 <= self.relora_prune <= 1,
               "optim.relora_prune", self.relora_prune, "a number in [0, 1]")


#: The memory options of the Fira / GaLore family (:class:`fira_optim.FiraAdamW`'s): a config of
#: another method refuses them (a user who asks for int8 states must not get fp32 ones).
FIRA_ONLY = ("step_in_backward", "state_dtype", "state_rounding", "stochastic_rounding")


@dataclass
class TrainConfig:
    """Steps, batch, schedule, evaluation, checkpoints and output of one run."""

    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 512
    """Sequences per optimizer step (the paper: 512 x 256 = 131K tokens)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward pass; batch_size / micro_batch_size is the number of
    gradient-accumulation steps. None means batch_size (no accumulation)."""
    warmup_fraction: float = 0.1
    """Fraction of the steps with a linear learning-rate warm-up from 0 (the paper: 10%)."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at this fraction of the peak learning rate (the paper: 10%)."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value before each step; 0 disables (the released
    harness's default: the Fira family relies on its norm-growth limiter instead)."""
    eval_every: int = 1000
    """Validation every this many steps (and always after the last step); 0 means only at the end."""
    save_every: int = 1000
    """Checkpoint every this many steps (and always after the last step); 0 means only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept in OUT/checkpoints (older ones are deleted; the newest never)."""
    seed: int = 0
    """Seed of the model initialisation, the data order and every random number generator."""
    out_dir: str = "runs/run"
    """Run directory: config.json, metrics.jsonl, summary.json, tb/ and checkpoints/ go here."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA devices that support it, float32 otherwise), "bf16"
    (autocast, also on CPU), "fp16" (autocast with dynamic loss scaling: GPUs without bf16, such
    as the T4 and V100; ``torch.amp.GradScaler``, or the step-in-backward handle's own scale) or
    "fp32"."""
    device: str = "auto"
    """"auto" (CUDA if available), "cpu" or "cuda"."""
    tensorboard: bool = True
    """Also write TensorBoard event files to OUT/tb."""
    progress: bool = True
    """Show a tqdm progress bar."""
    num_threads: int = 0
    """CPU threads for torch (``torch.set_num_threads``, process-wide); 0 keeps torch's default.
    On a CPU shared with other jobs, 1 can be many times faster than oversubscribed threads."""
    param_dtype: str = "float32"
    """Dtype of the model's weights: "float32", or "bfloat16" (pure bf16 weights, as in the
    low-memory 7B recipes of GaLore and APOLLO; pair with optim.stochastic_rounding=true)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (the Hugging Face
    model's gradient checkpointing): less memory, about a third more compute."""
    parallel: str = "none"
    """Data parallelism over the processes of a ``torchrun`` launch: "none" (one process),
    "ddp" (replicated weights, averaged gradients) or "fsdp2" (weights, gradients and
    optimizer states sharded by rows). Every rank trains on its rows of each global batch, so
    ``batch_size`` and the tokens per step stay what the recipe says at any world size."""
    dist_timeout_s: float = 0.0
    """Under ``train.parallel`` ddp / fsdp2: seconds a collective (gloo or NCCL) waits for the other
    processes of the launch before it fails with an error, as when one of them hangs (stopped, not
    dead: a dead one's peers fail at once); 0 keeps torch's default (30 minutes for gloo, 10 for
    NCCL). Give more than any process may spend alone while the others wait: building the data's
    cache at the start, a checkpoint, a validation pass, a projection refresh."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"train.{name}", value, "an integer >= 1")
        if self.micro_batch_size is not None:
            value = self.micro_batch_size
            _check(_is_int(value) and value >= 1 and self.batch_size % value == 0,
                   "train.micro_batch_size", value,
                   f"None or a divisor of train.batch_size={self.batch_size}")
        _check(_is_number(self.warmup_fraction) and 0 <= self.warmup_fraction < 1,
               "train.warmup_fraction", self.warmup_fraction, "a number in [0, 1)")
        _check(_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
               "train.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _check(_is_number(self.grad_clip) and self.grad_clip >= 0,
               "train.grad_clip", self.grad_clip, "a number >= 0 (0 disables clipping)")
        for name in ("eval_every", "save_every"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, f"train.{name}", value, "an integer >= 0")
        _check(_is_int(self.num_threads) and 0 <= self.num_threads <= MAX_THREADS, "train.num_threads",
               self.num_threads, f"an integer in [0, {MAX_THREADS}] (0: torch's default count)")
        # numpy's generators take no more (checked here: numpy's own error named no argument, and
        # came after the run folder was made)
        _check(_is_int(self.seed) and 0 <= self.seed <= MAX_SEED, "train.seed", self.seed,
               f"an integer in [0, {MAX_SEED}]")
        _check(_is_int(self.keep_last) and self.keep_last >= 1,
               "train.keep_last", self.keep_last, "an integer >= 1")
        _check(isinstance(self.out_dir, str) and self.out_dir != "", "train.out_dir", self.out_dir,
               "a non-empty path")
        _check(self.precision in PRECISIONS, "train.precision", self.precision, f"one of {PRECISIONS}")
        _check(self.device in DEVICES, "train.device", self.device, f"one of {DEVICES}")
        _check(self.parallel in PARALLEL_MODES, "train.parallel", self.parallel, f"one of {PARALLEL_MODES}")
        _check(_is_number(self.dist_timeout_s) and (self.dist_timeout_s == 0 or 1 <= self.dist_timeout_s
                                                    <= MAX_DIST_TIMEOUT_S),
               "train.dist_timeout_s", self.dist_timeout_s,
               f"0 (torch's default) or a number of seconds in [1, {MAX_DIST_TIMEOUT_S:.0e}]")
        for name in ("tensorboard", "progress", "activation_checkpointing"):
            _check(isinstance(getattr(self, name), bool), f"train.{name}", getattr(self, name), "a bool")
        _check(self.param_dtype in PARAM_DTYPES, "train.param_dtype", self.param_dtype,
               f"one of {PARAM_DTYPES}")

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward pass: ``micro_batch_size``, or the whole batch (None)."""
        return self.micro_batch_size or self.batch_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches accumulated into one optimizer step."""
        return self.batch_size // self.micro_batch


@dataclass
class RunConfig:
    """Everything one pre-training run depends on."""

    recipe: str = "custom"
    """Name of the recipe the config came from (informational)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The method and its hyper-parameters."""
    data: DataSpec = field(default_factory=DataSpec)
    """Corpus, tokenizer and sequence length."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch, schedule, evaluation, checkpoints, output."""

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelConfig), ("optim", OptimConfig), ("data", DataSpec),
                           ("train", TrainConfig)):
            _check(isinstance(getattr(self, name), kind), name, getattr(self, name),
                   f"a {kind.__name__}")
        _check(self.optim.method in METHODS, "optim.method", self.optim.method,
               f"one of {', '.join(sorted(METHODS))}")
        uses = METHODS[self.optim.method].uses
        fixed = VARIANTS.get(self.optim.method, {}).get("align_signs")
        if fixed is not None and self.optim.align_signs is not None and self.optim.align_signs != fixed:
            raise ValueError(f"optim.align_signs={self.optim.align_signs} contradicts method "
                             f"{self.optim.method!r}, which fixes align_signs={fixed}")
        for name in FIRA_ONLY:  # silently ignored by the other optimizers: refused
            value, default = getattr(self.optim, name), getattr(OptimConfig, name)
            if value != default and name not in uses:
                raise ValueError(f"optim.{name}={value!r} needs a Fira-family method (fira, galore, "
                                 f"fira-released, ...); optim.method={self.optim.method!r} has no such option")
        _check(not (self.optim.step_in_backward and self.train.grad_clip > 0), "train.grad_clip",
               self.train.grad_clip, "0 with optim.step_in_backward=true (the global gradient norm "
               "exists only after the last gradient, when most updates are done; Fira's "
               "norm-growth limiter bounds each matrix's update instead)")
        _check(self.train.precision != "fp16" or self.train.param_dtype == "float32", "train.param_dtype",
               self.train.param_dtype, "float32 with train.precision='fp16' (fp16 autocast keeps fp32 weights; "
               "bf16 weights need no loss scaling: use train.precision=bf16)")
        _check(self.train.precision != "fp16" or self.train.parallel != "fsdp2", "train.precision",
               self.train.precision, "'bf16' or 'fp32' with train.parallel='fsdp2' (fp16 loss scaling "
               "would find overflows in each rank's shard only; bf16 needs no scaling)")
        # refused by the optimizer too, but only once every rank has built its data and model,
        # and in the optimizer's terms (param_groups[0]['params'][0] is a DTensor)
        _check(self.optim.state_dtype != "int8" or self.train.parallel != "fsdp2", "optim.state_dtype",
               self.optim.state_dtype, "'float32' or 'bfloat16' with train.parallel='fsdp2' (int8 blocks of "
               "256 elements do not follow FSDP2's row shards; or train.parallel=ddp)")
        # peft wraps the model after it is built; DDP / FSDP2 must wrap it before the optimizer
        # sees the parameters, and the two orders do not compose yet.
        _check(self.train.parallel == "none" or not METHODS[self.optim.method].wraps_model,
               "train.parallel", self.train.parallel,
               f"'none' with optim.method={self.optim.method!r} (its adapters are not supported "
               "under DDP / FSDP2 yet)")
        _check(self.train.parallel != "fsdp2" or METHODS[self.optim.method].fsdp2,
               "train.parallel", self.train.parallel,
               f"'none' or 'ddp' with optim.method={self.optim.method!r} (its optimizer does not step "
               "FSDP2's sharded DTensor parameters)")
