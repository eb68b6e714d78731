"""The estimate of one run's memory: each option moves the part it should, by the formula."""

from __future__ import annotations

from dataclasses import replace

from fira_train.config.recipes import get_recipe
from fira_train.memory.matrix import llama_matrix_shapes
from fira_train.memory.run_estimate import estimate_run_bytes


def _estimate(method="fira", *, optim=(), train=()):
    config = get_recipe("60m")
    config = replace(config, optim=replace(config.optim, method=method, **dict(optim)),
                     train=replace(config.train, batch_size=1, micro_batch_size=1, **dict(train)))
    return config, estimate_run_bytes(config, 32000)


def _held_and_estimated(*overrides: str, dtype: str = "float32") -> tuple[int, int]:
    """The optimizer-state bytes the harness's optimizer holds after one step on micro (weights
    in ``dtype``), and the estimate of them."""
    import torch

    from fira_optim.state import optimizer_state_bytes
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import micro
    from fira_train.methods.model import build_model
    from fira_train.methods.registry import build_method

    config = apply_overrides(micro(), [*overrides, f"train.param_dtype={dtype}"])
    setup = build_method(build_model(config.model, 512, 32, seed=0).to(getattr(torch, dtype)), config)
    ids = torch.randint(0, 512, (2, 32))
    setup.model(input_ids=ids, labels=ids).loss.backward()
    setup.optimizer.step()
    # apollo-torch caches each matrix's random projection in its projector object: held (and
    # counted), but not what the estimate counts (the seed it can be redrawn from)
    cached = sum(t.numel() * t.element_size() for state in setup.optimizer.state.values()
                 if "projector" in state for t in vars(state["projector"]).values() if isinstance(t, torch.Tensor))
    if config.optim.method.startswith("apollo"):
        assert cached > 0
    return optimizer_state_bytes(setup.optimizer) - cached, estimate_run_bytes(config, 512)["optimizer_states"]


def test_the_parts_follow_the_formulas() -> None:
    config, adamw = _estimate("adamw")
    params = sum(a * b for a, b in llama_matrix_shapes(512, 1376, 8)) + 2 * 32000 * 512 + 512 * (2 * 8 + 1)
    assert adamw["weights"] == 4 * params and adamw["gradients"] == 4 * params
    assert adamw["optimizer_states"] == 8 * params
    _, fira = _estimate("fira")
    # the embedding and head (33M of 58M parameters) keep AdamW states under Fira too
    assert fira["weights"] == adamw["weights"] and fira["optimizer_states"] < 0.75 * adamw["optimizer_states"]
    assert fira["total"] == sum(fira[k] for k in ("weights", "gradients", "optimizer_states", "activations",
                                                  "step_temporaries"))


def test_torch_adamw_keeps_bf16_moments_for_bf16_weights() -> None:
    """torch.optim.AdamW's moments take the parameter's dtype; so do Fira's moments of the
    parameters it does not project at state_dtype="float32" (its low-rank moments stay fp32)."""
    import torch

    weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    weight.grad = torch.ones_like(weight)
    opt = torch.optim.AdamW([weight])
    opt.step()
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16
    _, fp32 = _estimate("adamw")
    _, bf16 = _estimate("adamw", train={"param_dtype": "bfloat16"})
    assert bf16["optimizer_states"] * 2 == fp32["optimizer_states"]
    _, fira = _estimate("fira", train={"param_dtype": "bfloat16"})
    _, fira32 = _estimate("fira")
    tables = 2 * 32000 * 512 + 512 * (2 * 8 + 1)  # embedding, head and norms: not projected
    assert fira32["optimizer_states"] - fira["optimizer_states"] == 2 * tables * (4 - 2)


def test_fira_states_are_what_the_optimizer_holds_for_each_weight_and_state_dtype() -> None:
    """The estimate counts the bytes FiraAdamW holds after a step, for fp32 and bf16 weights and
    each state dtype (micro, where building the model is cheap)."""
    import importlib.util

    import pytest

    int8 = ("int8",) if importlib.util.find_spec("torchao") else ()  # the int8 map needs torchao
    for dtype in ("float32", "bfloat16"):
        for state_dtype in ("float32", "bfloat16", *int8):
            held, estimated = _held_and_estimated("optim.method=fira", "optim.rank=8",
                                                  f"optim.state_dtype={state_dtype}", dtype=dtype)
            assert estimated == pytest.approx(held, rel=1e-3), (dtype, state_dtype)  # the step counters


def test_every_fira_variant_states_are_what_the_optimizer_holds() -> None:
    """Each Fira-family variant keeps its base's moments (Adagrad and RMSProp one, Adam two) for
    every parameter, and the limiter's norm only where the residual stays (GaLore drops it): the
    estimate counts the bytes it holds after a step, exactly but the step counters."""
    import torch

    import fira_optim
    from fira_optim.state import optimizer_state_bytes
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import micro
    from fira_train.methods.model import build_model
    from fira_train.methods.registry import build_method

    # rank 64 is micro's d_model: every matrix whole, but Fira-only-scaling's, projected at full rank
    for method, rank in [(method, rank) for method in fira_optim.VARIANTS for rank in (8, 64)]:
        config = apply_overrides(micro(), [f"optim.method={method}", f"optim.rank={rank}"])
        setup = build_method(build_model(config.model, 512, 32, seed=0), config)
        ids = torch.randint(0, 512, (2, 32))
        setup.model(input_ids=ids, labels=ids).loss.backward()
        setup.optimizer.step()
        counters = sum(state["step"].numel() * state["step"].element_size()
                       for state in setup.optimizer.state.values())
        held = optimizer_state_bytes(setup.optimizer) - counters
        assert estimate_run_bytes(config, 512)["optimizer_states"] == held, (method, rank)


def test_each_memory_option_shrinks_its_part() -> None:
    _, fira = _estimate("fira")
    _, hooks = _estimate("fira", optim={"step_in_backward": True})
    assert hooks["gradients"] == 4 * 32000 * 512  # the largest parameter's gradient alone
    _, int8 = _estimate("fira", optim={"state_dtype": "int8"})
    _, bf16 = _estimate("fira", optim={"state_dtype": "bfloat16"})
    assert int8["optimizer_states"] < bf16["optimizer_states"] < fira["optimizer_states"]
    assert 0.25 < int8["optimizer_states"] / fira["optimizer_states"] < 0.3
    _, weights = _estimate("fira", train={"param_dtype": "bfloat16"})
    assert weights["weights"] * 2 == fira["weights"]
    _, ckpt = _estimate("fira", train={"activation_checkpointing": True})
    assert ckpt["activations"] < fira["activations"]  # the logits stay


def test_step_in_backward_keeps_every_gradient_while_micro_batches_accumulate() -> None:
    """With gradient accumulation the updates in the backward pass wait for the last micro-batch:
    every gradient is alive after the first one (as without the option), and the estimate counts
    them all; with one micro-batch per step, the largest parameter's alone."""
    import torch

    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import micro
    from fira_train.run.training import build_training

    config = apply_overrides(micro(), ["optim.step_in_backward=true", "train.batch_size=8",
                                       "train.micro_batch_size=4"])
    training = build_training(config, 512, torch.device("cpu"))
    ids = torch.randint(0, 512, (4, 32))
    with training.in_backward.accumulate():  # a micro-batch before the last, as train_step runs it
        training.model(input_ids=ids, labels=ids).loss.backward()
    alive = sum(p.grad.numel() * p.grad.element_size() for p in training.model.parameters() if p.grad is not None)
    assert alive == sum(p.numel() * p.element_size() for p in training.model.parameters())
    assert estimate_run_bytes(config, 512)["gradients"] == alive
    accumulating = apply_overrides(get_recipe("60m"), ["train.batch_size=2", "train.micro_batch_size=1"])
    plain = estimate_run_bytes(accumulating, 32000)
    hooked = estimate_run_bytes(apply_overrides(accumulating, ["optim.step_in_backward=true"]), 32000)
    assert hooked["gradients"] == plain["gradients"]
    _, one = _estimate("fira", optim={"step_in_backward": True})
    assert one["gradients"] == 4 * 32000 * 512


def test_the_peers_states_are_what_their_optimizers_hold() -> None:
    """APOLLO, APOLLO-Mini, Flora and SlimAdam: the estimate counts the bytes the harness's
    optimizers hold after a step (checked on micro, where building them is cheap), for fp32 and
    bf16 weights (Flora's states stay fp32, the others' take the weights' dtype)."""
    import pytest

    for dtype in ("float32", "bfloat16"):
        for method in ("apollo", "apollo-mini", "flora", "slimadam", "adam-mini"):
            held, estimated = _held_and_estimated(f"optim.method={method}", "optim.rank=8", dtype=dtype)
            assert estimated == pytest.approx(held, rel=0.02), (method, dtype)


def test_the_step_temporaries_are_the_largest_whole_update_or_a_chunk() -> None:
    """fp32 states: torch's per-parameter Adam holds two copies of the largest parameter it steps
    (the embedding, 32000 x 512); low-precision states step a chunk of fp32 copies at a time."""
    from fira_optim.precision import CHUNK, CHUNK_TEMPORARY_BYTES

    for method in ("adamw", "fira", "galore"):
        _, fp32 = _estimate(method)
        assert fp32["step_temporaries"] == 2 * 32000 * 512 * 4, method
    _, bf16 = _estimate("adamw", train={"param_dtype": "bfloat16"})
    assert bf16["step_temporaries"] == 2 * 32000 * 512 * 2
    for optim in ({"state_dtype": "int8"}, {"state_dtype": "bfloat16"}):
        _, low = _estimate("fira", optim=optim)
        assert low["step_temporaries"] == CHUNK * CHUNK_TEMPORARY_BYTES
    _, rounded = _estimate("fira", optim={"stochastic_rounding": True}, train={"param_dtype": "bfloat16"})
    assert rounded["step_temporaries"] == CHUNK * CHUNK_TEMPORARY_BYTES


def test_a_projected_matrix_step_holds_its_low_rank_terms_and_the_paths_full_size_ones() -> None:
    """The largest projected matrix's step (1B, 2048 x 5461 at rank 512) where it exceeds the
    unprojected part's chunk (int8 states): three fp32 r x n low-rank terms; with bf16 weights
    also the fp32 gradient and working copy (8 bytes per element); on the reference path, and
    for FRUGAL's sign residual, the scaled residual and the update (8 more; GaLore's one, 4)."""
    from fira_optim.precision import CHUNK, CHUNK_TEMPORARY_BYTES

    config = get_recipe("1b")
    config = replace(config, optim=replace(config.optim, state_dtype="int8"),
                     train=replace(config.train, batch_size=1, micro_batch_size=1, param_dtype="bfloat16"))
    numel, low_rank = 2048 * 5461, 3 * 4 * 512 * 5461
    assert low_rank > CHUNK * CHUNK_TEMPORARY_BYTES

    def temporaries(**changes):
        train = {k: changes.pop(k) for k in ("param_dtype",) if k in changes}
        changed = replace(config, optim=replace(config.optim, **changes), train=replace(config.train, **train))
        return estimate_run_bytes(changed, 32000)["step_temporaries"]

    assert temporaries() == 8 * numel + low_rank
    assert temporaries(param_dtype="float32") == low_rank
    assert temporaries(implementation="reference") == 16 * numel + low_rank
    assert temporaries(implementation="reference", param_dtype="float32") == 8 * numel + low_rank
    assert temporaries(method="frugal", param_dtype="float32") == 8 * numel + low_rank
    assert temporaries(method="galore", implementation="reference", param_dtype="float32") == 4 * numel + low_rank
    adamw = replace(config, optim=replace(config.optim, method="adamw", state_dtype="float32"))
    assert estimate_run_bytes(adamw, 32000)["step_temporaries"] == 2 * 32000 * 2048 * 2  # its own rule


def test_torch_adamw_on_cuda_holds_a_weights_sized_temporary() -> None:
    """On CUDA torch's AdamW steps every parameter at once (``foreach``), holding sqrt(v) of all
    of them; the CPU's per-parameter step holds two temporaries of the largest parameter."""
    import torch

    parts = ("weights", "gradients", "optimizer_states", "activations", "step_temporaries")
    config, cpu = _estimate("adamw")
    cuda = estimate_run_bytes(config, 32000, "cuda")
    assert cuda["step_temporaries"] == cuda["weights"] > cpu["step_temporaries"]
    # on CUDA only live tensors count: the activations are gone when the step's temporaries exist
    assert cuda["total"] == sum(cuda[k] for k in parts) - min(cuda["activations"], cuda["step_temporaries"])
    assert cpu["total"] == sum(cpu[k] for k in parts)
    # adamw-grouped: one foreach step per group (matrices, then embedding + head + norms)
    grouped_config, _ = _estimate("adamw-grouped")
    grouped = estimate_run_bytes(grouped_config, 32000, "cuda")
    matrices = sum(a * b for a, b in llama_matrix_shapes(512, 1376, 8))
    assert grouped["step_temporaries"] == 4 * max(matrices, 2 * 32000 * 512 + 512 * 17) < grouped["weights"]
    # the Fira family steps its unprojected parameters itself: the same parts on either device
    fira_config, fira_cpu = _estimate("fira")
    fira_cuda = estimate_run_bytes(fira_config, 32000, "cuda")
    assert {k: fira_cuda[k] for k in parts} == {k: fira_cpu[k] for k in parts}
    assert fira_cuda["total"] == fira_cpu["total"] - min(fira_cpu["activations"], fira_cpu["step_temporaries"])
    # updates inside the backward pass run among the activations: the sum, on CUDA too
    sib_config, sib_cpu = _estimate("fira", optim={"step_in_backward": True})
    assert estimate_run_bytes(sib_config, 32000, "cuda")["total"] == sib_cpu["total"]
    # the size of that temporary, as torch's multi-tensor AdamW allocates it
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(16))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, foreach=True)
    sizes = []
    real_sqrt = torch._foreach_sqrt

    def recording_sqrt(tensors):
        out = real_sqrt(tensors)
        sizes.append(sum(t.numel() for t in out))
        return out

    torch._foreach_sqrt = recording_sqrt
    try:
        opt.step()
    finally:
        torch._foreach_sqrt = real_sqrt
    assert sizes == [sum(p.numel() for p in params)]


def test_the_state_estimate_equals_every_committed_measurement() -> None:
    """The optimizer states that ``memory --measure`` counted in every committed table (CPU, fp32
    and bf16 weights; H200, bf16 weights) are what the estimate says today, to the step counters
    (a few bytes per parameter tensor). Each table's config: its recipe and the key=value
    overrides of its command."""
    import json
    import re
    from pathlib import Path

    from fira_train.config.method_spec import parse_method_specs
    from fira_train.config.overrides import apply_overrides

    root = Path(__file__).parents[3] / "docs" / "results" / "memory-measured"
    checked = 0
    for path in sorted(root.rglob("memory.json")):
        record = json.loads(path.read_text())
        command = next(line for line in record["command"].split("\n") if line.startswith("fira-train memory"))
        overrides = re.findall(r"(?<= )(?:train|optim|data|model)\.\w+=\S+", command)
        base = apply_overrides(get_recipe(record["recipe"]), overrides)
        for row in record["rows"]:
            config = parse_method_specs(row["method"])[0].config(base, ".")
            estimated = estimate_run_bytes(config, row["measured"]["vocab_size"], row["measured"]["device"])
            assert abs(estimated["optimizer_states"] - row["measured"]["optimizer_state_bytes"]) <= 4096, \
                (str(path), row["method"])
            checked += 1
    assert checked >= 50


def test_lora_is_refused_not_estimated_as_full_adamw() -> None:
    """LoRA's adapters beside frozen weights are not modelled: asking is an error naming the
    method (a number would be full-weight AdamW's), and :func:`is_estimated` says so first."""
    import pytest

    from fira_train.memory.run_estimate import is_estimated

    assert not is_estimated("lora") and not is_estimated("relora") and is_estimated("fira")
    with pytest.raises(ValueError, match="optim.method='lora'"):
        _estimate("lora")


def test_on_cuda_a_plain_step_holds_every_matrix_projected_gradient_at_once() -> None:
    """Fira's step plans every matrix (its R = P^T G) before it updates one: on CUDA all those R
    are live tensors together (1.1 GiB at 1B); inside the backward pass one matrix's at a time,
    and on the CPU they reuse the heap the activations freed."""
    from fira_train.memory.matrix import llama_matrix_shapes

    config = get_recipe("1b")
    config = replace(config, train=replace(config.train, batch_size=1, micro_batch_size=1, param_dtype="bfloat16"))
    every_r = sum(4 * 512 * max(a, b) for a, b in llama_matrix_shapes(2048, 5461, 24))
    one = 8 * 2048 * 5461 + 3 * 4 * 512 * 5461  # the largest matrix's own step (bf16 weights)
    assert estimate_run_bytes(config, 32000, "cuda")["step_temporaries"] == one + every_r
    in_backward = replace(config, optim=replace(config.optim, step_in_backward=True))
    embedding = 2 * 32000 * 2048 * 2  # torch's Adam step of the embedding (or head): more than one matrix's
    assert embedding > one
    assert estimate_run_bytes(in_backward, 32000, "cuda")["step_temporaries"] == embedding
    assert estimate_run_bytes(config, 32000, "cpu")["step_temporaries"] == embedding
    # fp32 weights and states: the fast path batches the updates, Adam's directions N beside R
    fp32 = replace(config, train=replace(config.train, param_dtype="float32"))
    assert estimate_run_bytes(fp32, 32000, "cuda")["step_temporaries"] == 3 * 4 * 512 * 5461 + 2 * every_r


def test_a_rank_above_every_matrix_projects_nothing_as_the_optimizer_decides() -> None:
    import warnings

    import torch

    from fira_train.memory.run_estimate import projected_shapes, projects_nothing

    # 60m: width 512, MLP 1376; the optimizer's own warning is the reference for "nothing projected"
    for method, rank, nothing in (("fira", 4096, True), ("fira", 512, True), ("fira", 511, False),
                                  ("galore", 128, False), ("adamw", 4096, False), ("apollo", 4096, False)):
        config, _ = _estimate(method, optim={"rank": rank})
        assert projects_nothing(config) is nothing, (method, rank)
    config, _ = _estimate("fira", optim={"rank": 511})
    assert len(projected_shapes(config)) == 7 * 8  # every attention and MLP matrix of the 8 layers
    from fira_optim import Fira

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Fira([{"params": [torch.nn.Parameter(torch.zeros(512, 1376))], "rank": 512}])
    assert any("none is projected" in str(w.message) for w in caught)
