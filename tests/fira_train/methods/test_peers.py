"""The paper's other baselines as methods: APOLLO / APOLLO-Mini (apollo-torch), Flora (flora-opt),
SlimAdam (written here): their settings, state sizes, checkpoints, refusals and CLI runs."""

from __future__ import annotations

import copy
import io
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fira_train.cli import main
from fira_train.config.resolve import resolved_lr
from fira_train.methods import apollo as apollo_module
from fira_train.methods import flora as flora_module
from fira_train.methods.flora import compresses_momentum
from fira_train.methods.registry import METHODS, build_method, get_method
from fira_train.methods.slimadam import SlimAdamW, compressed_dims, second_moment_numel, slimadam_param_groups
from tests.fira_train.harness_fixtures import micro_config
from tests.fira_train.methods.method_fixtures import (
    learnable_batch,
    method_config,
    method_model,
    train_step,
)

PEERS = ("apollo", "apollo-mini", "flora", "slimadam")


def _weights_only_roundtrip(optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 2 and "_proj" in n}


# --- registry entries --------------------------------------------------------------------------

def test_peers_are_registered_with_their_published_learning_rates() -> None:
    assert set(PEERS) <= set(METHODS)
    assert {m: get_method(m).default_lr for m in PEERS} == {
        "apollo": 0.01, "apollo-mini": 0.01, "flora": 0.01, "slimadam": 1e-3}
    assert get_method("apollo").uses_rank and get_method("flora").uses_rank
    assert not get_method("apollo-mini").uses_rank and not get_method("slimadam").uses_rank  # rank 1 / none
    assert not any(get_method(m).fsdp2 for m in PEERS)
    assert all(get_method(m).fsdp2 for m in ("adamw", "fira", "galore", "adam-mini"))


@pytest.mark.parametrize("method", PEERS)
def test_each_peer_trains_a_tiny_model(method: str) -> None:
    config = method_config(method)
    setup = build_method(method_model(config), config)
    batch = learnable_batch()
    losses = [train_step(setup, batch) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert setup.optimizer.param_groups[0]["lr"] == pytest.approx(resolved_lr(config))


@pytest.mark.parametrize("method", PEERS)
def test_fsdp2_is_refused_with_a_clear_error(method: str) -> None:
    with pytest.raises(ValueError, match=rf"train.parallel must be 'none' or 'ddp' with optim.method='{method}'"):
        method_config(method, "train.parallel=fsdp2")
    method_config(method, "train.parallel=ddp")  # DDP is accepted
    config = method_config(method)
    config.train.parallel = "fsdp2"  # past the config check: the builder refuses too
    with pytest.raises(ValueError, match="does not run under train.parallel='fsdp2'"):
        build_method(method_model(config), config)


# --- APOLLO / APOLLO-Mini (apollo-torch) -----------------------------------------------------

def _apollo_groups(setup) -> tuple[dict, dict]:
    regular, projected = setup.optimizer.param_groups
    return regular, projected


@pytest.mark.parametrize(("method", "rank", "scale_type", "scale", "scale_front"),
                         [("apollo", 8, "channel", 1.0, False), ("apollo-mini", 1, "tensor", 128.0, True)])
def test_apollo_settings_and_state_size(method, rank, scale_type, scale, scale_front) -> None:
    config = method_config(method)
    setup = build_method(method_model(config), config)
    regular, projected = _apollo_groups(setup)
    assert type(setup.optimizer).__name__ == "APOLLOAdamW"
    assert "rank" not in regular  # the package gives a group without a rank key plain AdamW
    assert {k: projected[k] for k in ("rank", "proj", "scale_type", "scale", "update_proj_gap", "proj_type")} == {
        "rank": rank, "proj": "random", "scale_type": scale_type, "scale": scale, "update_proj_gap": 2,
        "proj_type": "std"}
    assert setup.optimizer.scale_front is scale_front and not setup.optimizer.disable_nl
    matrices = _matrices(setup.model)
    assert {id(p) for p in projected["params"]} == {id(p) for p in matrices.values()}
    train_step(setup, learnable_batch())
    for p in matrices.values():
        state = setup.optimizer.state[p]
        # Adam's moments of the r x max(m, n) projected gradient, the limiter's previous norm
        assert state["exp_avg"].numel() == state["exp_avg_sq"].numel() == rank * max(p.shape)
        assert state["scaled_grad"].numel() == 1


def test_apollo_state_dict_is_weights_only_and_resumes_exactly() -> None:
    config = method_config("apollo")  # T = 2: the resumed steps cross projection refreshes
    setup = build_method(method_model(config), config)
    for i in range(3):
        train_step(setup, learnable_batch(i))
    state = _weights_only_roundtrip(setup.optimizer)
    resumed = build_method(copy.deepcopy(setup.model), config)
    resumed.optimizer.load_state_dict(state)
    for i in range(3, 7):
        train_step(setup, learnable_batch(i))
        train_step(resumed, learnable_batch(i))
    for (name, a), b in zip(setup.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    # the live optimizer still holds projector objects, not the saved dictionaries
    p = next(iter(_matrices(setup.model).values()))
    assert not isinstance(setup.optimizer.state[p]["projector"], dict)


@pytest.mark.parametrize("method", ["flora", "apollo"])
def test_a_peer_s_float32_states_of_bf16_weights_resume_exactly(method: str) -> None:
    """torch's load cast every floating-point state to its parameter's dtype: flora's fp32 moments
    of bf16 weights (train.param_dtype=bfloat16) came back rounded to bf16, and the resumed run
    went on from other moments than the one that was not stopped."""
    config = method_config(method, "train.param_dtype=bfloat16")
    setup = build_method(method_model(config).to(torch.bfloat16), config)
    for i in range(3):
        train_step(setup, learnable_batch(i))
    state = _weights_only_roundtrip(setup.optimizer)
    resumed = build_method(copy.deepcopy(setup.model), config)
    resumed.optimizer.load_state_dict(state)
    for p, q in zip(setup.model.parameters(), resumed.model.parameters()):
        for key, value in setup.optimizer.state[p].items():
            if torch.is_tensor(value):
                assert resumed.optimizer.state[q][key].dtype == value.dtype, key
                assert torch.equal(resumed.optimizer.state[q][key], value), key
    for i in range(3, 6):
        train_step(setup, learnable_batch(i))
        train_step(resumed, learnable_batch(i))
    for (name, a), b in zip(setup.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_missing_apollo_package_is_a_clear_import_error(monkeypatch) -> None:
    apollo_module.weights_only_class.cache_clear()
    monkeypatch.setitem(sys.modules, "apollo_torch", None)
    try:
        config = method_config("apollo")
        with pytest.raises(ImportError, match="apollo-torch==1.0.3"):
            build_method(method_model(config), config)
    finally:
        apollo_module.weights_only_class.cache_clear()


# --- Flora (flora-opt) -------------------------------------------------------------------------

def test_flora_compresses_the_momentum_of_the_matrices_and_resamples_every_t_steps() -> None:
    config = method_config("flora", "optim.update_proj_gap=3")
    setup = build_method(method_model(config), config)
    (group,) = setup.optimizer.param_groups
    assert (group["rank"], group["kappa"], group["beta1"]) == (8, 3, 0.9)
    assert not group["relative_step"] and group["scale_parameter"] and not group["quantization"]
    train_step(setup, learnable_batch())
    matrices = _matrices(setup.model)
    seeds = {n: setup.optimizer.state[p]["seed"] for n, p in matrices.items()}
    assert all(compresses_momentum(tuple(p.shape), 8) for p in matrices.values())
    for name, p in setup.model.named_parameters():
        state = setup.optimizer.state[p]
        if compresses_momentum(tuple(p.shape), 8):  # the matrices (and this test's 96 x 64 tables)
            assert state["exp_avg"].numel() == 8 * max(p.shape)  # r x n instead of m x n
        else:
            assert p.dim() == 1 and state["exp_avg"].shape == p.shape  # norms keep a full first moment
        if p.dim() == 2:
            m, n = p.shape
            assert state["exp_avg_sq_row"].numel() + state["exp_avg_sq_col"].numel() == m + n  # Adafactor
    train_step(setup, learnable_batch(1))
    assert {n: setup.optimizer.state[p]["seed"] for n, p in matrices.items()} == seeds
    train_step(setup, learnable_batch(2))  # step 3 = kappa: a new projection
    assert all(setup.optimizer.state[p]["seed"] != seeds[n] for n, p in matrices.items())
    assert _weights_only_roundtrip(setup.optimizer)["state"]


def test_flora_rule_leaves_out_embeddings_and_too_small_matrices() -> None:
    assert compresses_momentum((64, 176), 16) and compresses_momentum((2048, 5461), 512)
    assert not compresses_momentum((32000, 512), 128)  # an embedding: aspect ratio > 4
    assert not compresses_momentum((64, 8), 16)  # rank above the smaller side
    assert not compresses_momentum((64,), 1)


def test_missing_flora_package_is_a_clear_import_error(monkeypatch) -> None:
    flora_module._import_flora.cache_clear()
    monkeypatch.setitem(sys.modules, "flora_opt", None)
    monkeypatch.setitem(sys.modules, "flora_opt.optimizers.torch.flora", None)
    try:
        config = method_config("flora")
        with pytest.raises(ImportError, match="flora-opt"):
            build_method(method_model(config), config)
    finally:
        flora_module._import_flora.cache_clear()


@pytest.mark.parametrize("method", ["apollo", "flora"])
def test_a_fresh_package_optimizer_has_an_empty_state_until_its_first_step(method: str) -> None:
    """The packages seed every parameter's state when built; held back, a fresh optimizer looks
    fresh to torch.distributed.checkpoint (which then gives it the keys to load: see
    test_peers_ddp.py), and the first step puts the package's own seeds in place."""
    config = method_config(method)
    setup = build_method(method_model(config), config)
    assert len(setup.optimizer.state) == 0
    train_step(setup, learnable_batch())
    seeds = [setup.optimizer.state[p]["seed"] for g in setup.optimizer.param_groups for p in g["params"]]
    # the packages number the parameters; the run's seed shifts them by a multiple of their count
    first = 1 + config.train.seed * (len(seeds) + (method == "flora"))
    assert seeds == list(range(first, first + len(seeds)))
    # the run's seed moves every projection seed, as train.seed moves every other draw
    again = method_config(method, "train.seed=3")
    moved = build_method(method_model(again), again)
    train_step(moved, learnable_batch())
    shifted = [moved.optimizer.state[p]["seed"] for g in moved.optimizer.param_groups for p in g["params"]]
    assert not set(shifted) & set(seeds) and len(set(shifted)) == len(shifted)


def test_apollo_draws_its_random_projections_from_the_runs_seed() -> None:
    def projection(seed: int) -> torch.Tensor:
        config = method_config("apollo", f"train.seed={seed}")
        setup = build_method(method_model(config), config)
        train_step(setup, learnable_batch())
        matrix = next(p for g in setup.optimizer.param_groups if "rank" in g for p in g["params"])
        return setup.optimizer.state[matrix]["projector"].ortho_matrix.clone()

    assert torch.equal(projection(0), projection(0)) and not torch.equal(projection(0), projection(1))


# --- SlimAdam (written here) -------------------------------------------------------------------

def _random_grads(params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_slimadam_without_compression_is_torch_adamw_bit_for_bit(weight_decay: float) -> None:
    torch.manual_seed(0)
    ours = [torch.randn(7, 5), torch.randn(5), torch.randn(3, 4, 2)]
    theirs = [p.clone() for p in ours]
    slim = SlimAdamW(ours, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    adamw = torch.optim.AdamW(theirs, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                              foreach=False)
    for step in range(5):
        _random_grads(ours, step)
        _random_grads(theirs, step)
        slim.step()
        adamw.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(slim.state[a]["exp_avg_sq"], adamw.state[b]["exp_avg_sq"])


def test_slimadam_compressed_second_moment_is_the_mean_along_the_dimension() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    reference = w.clone()
    opt = SlimAdamW([{"params": [w], "compress_dims": (0,)}], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    m = torch.zeros(6, 4)
    v = torch.zeros(1, 4)
    for t in range(1, 4):
        _random_grads([w], t)
        g = w.grad.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * (g * g).mean(dim=0, keepdim=True)
        reference -= 0.1 / (1 - 0.9**t) * m / ((v / (1 - 0.99**t)).sqrt() + 1e-8)
    assert opt.state[w]["exp_avg_sq"].shape == (1, 4)
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"], v)
    torch.testing.assert_close(w, reference)


def test_slimadam_rules_per_layer_type_and_state_size() -> None:
    config = method_config("slimadam")
    setup = build_method(method_model(config), config)
    expected = {"q_proj": (1,), "k_proj": (1,), "v_proj": (0,), "o_proj": (0,), "gate_proj": (0,),
                "up_proj": (0,), "down_proj": (0,), "embed_tokens": (1,), "lm_head": (1,), "norm": None}
    train_step(setup, learnable_batch())
    total_first = total_second = 0
    for name, p in setup.model.named_parameters():
        dims = compressed_dims(name, p)
        kind = next(k for k in expected if k in name)
        assert dims == expected[kind], name
        state = setup.optimizer.state[p]
        assert state["exp_avg"].shape == p.shape  # the full first moment
        kept = list(p.shape)
        for d in dims or ():
            kept[d] = 1
        assert list(state["exp_avg_sq"].shape) == kept, name
        assert state["exp_avg_sq"].numel() == second_moment_numel(tuple(p.shape), dims)
        if p.dim() == 2:  # m x n + a vector of the kept dimension
            assert state["exp_avg_sq"].numel() == (p.shape[0] if dims == (1,) else p.shape[1])
        total_first += p.numel()
        total_second += state["exp_avg_sq"].numel()
    assert total_second < 0.1 * total_first
    groups = slimadam_param_groups(setup.model)
    assert sum(len(g["params"]) for g in groups) == len(list(setup.model.parameters()))


def test_slimadam_tied_head_follows_the_embedding_rule() -> None:
    config = method_config("slimadam", "model.tie_word_embeddings=true")
    model = method_model(config)
    groups = slimadam_param_groups(model)
    embedding = model.get_input_embeddings().weight
    (group,) = [g for g in groups if any(p is embedding for p in g["params"])]
    assert group["compress_dims"] == (1,)
    assert sum(p is embedding for g in groups for p in g["params"]) == 1


def test_slimadam_rejects_a_dimension_the_parameter_lacks() -> None:
    with pytest.raises(ValueError, match="compress_dims"):
        SlimAdamW([{"params": [torch.zeros(3)], "compress_dims": (1,)}])


# --- the command line --------------------------------------------------------------------------

def _data_flags(tmp_path: Path) -> list[str]:
    config = micro_config(tmp_path)  # writes the corpus
    return ["--data", config.data.source, f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300",
            "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false", "train.num_threads=1"]


@pytest.mark.parametrize("method", PEERS)
def test_pretrain_cli_runs_each_peer_and_resumes_exactly(method: str, tmp_path: Path, capsys, caplog) -> None:
    out = tmp_path / method
    argv = ["pretrain", "--recipe", "micro", "--method", method, "--steps", "4", "--save-every", "2",
            "--eval-every", "0", "--out", str(out), *_data_flags(tmp_path)]
    assert main(argv) == 0
    (result,) = [line for line in capsys.readouterr().out.splitlines() if "validation perplexity" in line]
    assert result.startswith(f"{method}: validation perplexity")
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    with caplog.at_level(logging.INFO):
        assert main([*argv, "--resume"]) == 0  # from the optimizer state saved at step 2
    assert "from step 2" in caplog.text
    assert result in capsys.readouterr().out.splitlines()  # the same perplexity as without a stop


# --- the peers' arithmetic, transcribed ----------------------------------------------------------

@pytest.mark.parametrize("method", ["apollo", "apollo-mini"])
def test_apollo_build_is_the_package_arithmetic_transcribed(method: str) -> None:
    """float64, weight decay on, T = 2 (projections drawn at steps 0, 2, 4), a 10x gradient at
    step 3 (the limiter engages): the package's arithmetic, written out -- Adam on the projected
    gradient with the bias correction folded into the step size (so the channel / tensor factor
    and the limiter see un-corrected moments), sqrt(scale) before (Mini) or after the limiter,
    weight decay after the update; Hugging Face AdamW on the embeddings, norms and head."""
    from apollo_torch.random_projector import next_seed

    config = method_config(method, "optim.weight_decay=0.1")
    model = method_model(config).double()
    reference = copy.deepcopy(model)
    optimizer = build_method(model, config).optimizer
    regular, projected = optimizer.param_groups
    rank, scale, front = projected["rank"], projected["scale"], optimizer.scale_front
    (b1, b2), eps, lr, wd, gap = config.optim.betas, config.optim.eps, 0.01, 0.1, 2
    seeds = {id(p): s for p, s in optimizer._initial_seeds.items()}
    matrices = {id(p) for p in projected["params"]}
    states: dict = {}
    g = torch.Generator().manual_seed(2)
    for t in range(6):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) * (10 if t == 3 else 1)
                 for p in model.parameters()]
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad.clone()
        optimizer.step()
        step_size = lr * (1 - b2 ** (t + 1)) ** 0.5 / (1 - b1 ** (t + 1))
        with torch.no_grad():
            for p, q, grad in zip(model.parameters(), reference.parameters(), grads):
                s = states.setdefault(id(p), {"seed": seeds.get(id(p)), "m": 0.0, "v": 0.0})
                right = p.dim() == 2 and p.shape[0] >= p.shape[1]
                if id(p) in matrices:
                    if t % gap == 0:  # a new random projection from the next seed
                        shape = (rank, p.shape[1]) if right else (p.shape[0], rank)
                        draw = torch.randn(shape, generator=torch.Generator().manual_seed(s["seed"]))
                        # drawn and scaled in float32, as the package does for any gradient dtype
                        s["P"], s["seed"] = (draw / rank ** 0.5).double(), next_seed(s["seed"])
                    low = grad @ s["P"].T if right else s["P"].T @ grad
                else:
                    low = grad
                s["m"] = b1 * s["m"] + (1 - b1) * low
                s["v"] = b2 * s["v"] + (1 - b2) * low * low
                normed = s["m"] / (s["v"].sqrt() + eps)  # un-corrected
                if id(p) in matrices:
                    if projected["scale_type"] == "channel":
                        dim = 1 if right else 0
                        phi = normed.norm(dim=dim, keepdim=True) / (low.norm(dim=dim, keepdim=True) + 1e-8)
                    else:
                        phi = normed.norm() / (low.norm() + 1e-8)
                    normed = grad * phi * (scale ** 0.5 if front else 1.0)
                    norm = normed.norm()
                    if "prev" in s and norm > 1.01 * (s["prev"] + 1e-8):
                        normed = normed * (1.01 * (s["prev"] + 1e-8) / norm)
                        norm = normed.norm()
                    s["prev"] = norm
                    normed = normed * (1.0 if front else scale ** 0.5)
                q -= step_size * normed
                q -= lr * wd * q
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=lambda m: f"step {t} {name}: {m}")


def test_flora_build_is_the_package_s_flora_at_seed_0() -> None:
    """The harness's Flora is the package's ``Flora`` with its defaults over every trainable
    parameter, across two resamplings (kappa = 3), bit for bit."""
    from flora_opt.optimizers.torch.flora import Flora

    config = method_config("flora", "optim.update_proj_gap=3", "optim.weight_decay=0.1")
    model = method_model(config).double()
    reference = copy.deepcopy(model)
    ours = build_method(model, config).optimizer
    theirs = Flora(list(reference.parameters()), lr=0.01, rank=8, kappa=3, beta1=0.9, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(7):
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
