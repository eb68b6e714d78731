"""Fira on FSDP2 row shards and with DDP split refreshes: 2 gloo processes on CPU, each test
under a timeout, compared with a one-process run on the same gradients."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from fira_optim import FiraAdamW, NonFiniteGradientError
from tests.multiprocess import run_ranks

# std rule: left when m < n, right when m >= n (a square matrix projects on the right).
# 5, 13, 7 and 9 rows do not divide by 2: FSDP2 gives the ranks 3/2, 7/6, 4/3 and 5/4 rows.
SHAPES = {"left": (5, 12), "right": (13, 6), "square": (7, 7)}
PLAIN_SHAPES = {"bias": (9,), "head": (3, 4)}
RANK, GAP, STEPS = 2, 3, 7

CONFIGS: dict[str, dict] = {
    "fira": {},
    "reference": {"implementation": "reference"},
    "galore": {"residual": "drop"},
    "matrix-scaling": {"scaling": "matrix"},
    "only-scaling": {"only_scaling": True},
    "released": {"arithmetic": "released"},
    "randomized": {"projector": "randomized"},
    "stagger": {"stagger": True},
    "frugal": {"residual": "sign", "limiter": "none"},
    "adagrad": {"base": "adagrad"},
    "float32": {"dtype": torch.float32},
    # bf16 weights: gradients gathered and bases broadcast in fp32, the working dtype
    "bfloat16": {"dtype": torch.bfloat16},
    # gradients of rank 1 < RANK: inside the subspace at each refresh, where ||S|| is formed
    # explicitly (fira_optim.residual.cancelled), one all-reduce per such matrix
    "low-rank-gradients": {"gradient_rank": 1},
}
#: Config keys of the test itself, not FiraAdamW options.
TEST_KEYS = ("dtype", "gradient_rank")


def _initial(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {**SHAPES, **PLAIN_SHAPES}
    return {name: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for name, shape in shapes.items()}


def _gradient(name: str, shape: tuple, step: int, dtype: torch.dtype, rank: int | None = None) -> torch.Tensor:
    # Growing scale: the norm-growth limiter acts on some steps.
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    if rank is not None and len(shape) == 2:
        low = torch.randn(shape[0], rank, generator=g, dtype=torch.float64) @ torch.randn(
            rank, shape[1], generator=g, dtype=torch.float64)
        return (1.0 + step) * low.to(dtype)
    return (1.0 + step) * torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _optimizer(params: dict[str, torch.Tensor], config: dict) -> FiraAdamW:
    options = {k: v for k, v in config.items() if k not in TEST_KEYS}
    groups = [
        {"params": [params[k] for k in SHAPES], "rank": RANK, "update_proj_gap": GAP},
        {"params": [params[k] for k in PLAIN_SHAPES], "rank": None},
    ]
    return FiraAdamW(groups, lr=0.05, weight_decay=0.1, **options)


def _train(params: dict[str, torch.Tensor], config: dict, make_grad) -> FiraAdamW:
    optimizer = _optimizer(params, config)
    for step in range(STEPS):
        for name, p in params.items():
            p.grad = make_grad(name, tuple(p.shape), step)
        optimizer.step()
    return optimizer


def _reference(config: dict):
    dtype = config.get("dtype", torch.float64)
    params = {k: torch.nn.Parameter(v) for k, v in _initial(dtype).items()}
    optimizer = _train(params, config, lambda n, s, t: _gradient(n, s, t, dtype, config.get("gradient_rank")))
    states = {name: dict(optimizer.state[p]) for name, p in params.items() if name in SHAPES}
    return {k: v.detach() for k, v in params.items()}, states


@functools.cache
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _shard(tensor: torch.Tensor):
    """This rank's rows of ``tensor`` as a DTensor ``Shard(0)``: FSDP2's layout."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(tensor, _mesh(), [Shard(0)], src_data_rank=None)


def _fsdp2_worker(rank: int, world: int, names: list[str]) -> dict:
    import fira_optim.pipeline as pipeline

    out = {}
    cancelled, redone = pipeline.cancelled, []
    pipeline.cancelled = lambda *args: redone.extend(found := cancelled(*args)) or found
    for config_name in names:
        config = CONFIGS[config_name]
        dtype = config.get("dtype", torch.float64)
        params = {k: torch.nn.Parameter(_shard(v)) for k, v in _initial(dtype).items()}
        redone.clear()
        optimizer = _train(params, config,
                           lambda n, s, t: _shard(_gradient(n, s, t, dtype, config.get("gradient_rank"))))
        out[config_name] = {
            "redone": len(redone),
            "local": {k: p.to_local().detach().clone() for k, p in params.items()},
            "state": {
                name: {key: value.full_tensor() if hasattr(value, "full_tensor") else value
                       for key, value in optimizer.state[params[name]].items()}
                for name in SHAPES
            },
            "state_local_rows": {
                name: {key: tuple(value.to_local().shape) for key, value in optimizer.state[params[name]].items()
                       if key != "step"}
                for name in SHAPES
            },
        }
    return out


@pytest.mark.timeout(120)
def test_fsdp2_shards_equal_one_process_chunks(tmp_path):
    """Each rank's rows of every parameter, and the gathered optimizer state, equal the
    one-process run, for left, right and square projections with uneven rows, across two
    refreshes, for every variant and both update paths."""
    results = run_ranks(_fsdp2_worker, 2, tmp_path, list(CONFIGS), timeout=100)
    for config_name, config in CONFIGS.items():
        dtype = config.get("dtype", torch.float64)
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        state_tol = tol
        if dtype == torch.bfloat16:
            # The gradients do not depend on the weights, so the states (fp32) follow the
            # one-process run to fp32 round-off; the bf16 weights to one bf16 rounding step,
            # which the sharded projection's other order of sums can flip.
            tol = dict(rtol=2e-2, atol=1e-2)
        ref_params, ref_states = _reference(config)
        for rank, result in enumerate(results):
            got = result[config_name]
            for name, full in ref_params.items():
                expected = full.chunk(2)[rank]
                torch.testing.assert_close(got["local"][name], expected, **tol, msg=f"{config_name} {name} rank {rank}")
            for name in SHAPES:
                for key, value in ref_states[name].items():
                    torch.testing.assert_close(
                        got["state"][name][key], value, **state_tol, msg=f"{config_name} state {name}.{key}"
                    )
    # The sharded states are sharded: a left basis and the states of a right R follow the rows.
    local_rows = results[1]["fira"]["state_local_rows"]
    assert local_rows["left"]["basis"] == (2, RANK)  # 5 rows: ranks hold 3 and 2
    assert local_rows["left"]["exp_avg"] == (RANK, 12)  # R = P^T G is replicated
    assert local_rows["right"]["basis"] == (6, RANK)  # Q replicated
    assert local_rows["right"]["exp_avg"] == (6, RANK)  # 13 rows: ranks hold 7 and 6
    assert local_rows["square"]["exp_avg_sq"] == (3, RANK)
    # the explicit ||S|| of the fast path ran under FSDP2, on the same matrices on both ranks
    assert results[0]["low-rank-gradients"]["redone"] == results[1]["low-rank-gradients"]["redone"] > 0


def _nonfinite_worker(rank: int, world: int, mode: str, bad_step: int) -> dict:
    params = {k: torch.nn.Parameter(_shard(v)) for k, v in _initial(torch.float64).items()}
    optimizer = _optimizer(params, {"nonfinite": mode})
    outcome, warned = "stepped", []
    for step in range(bad_step + 1):
        for name, p in params.items():
            grad = _gradient(name, tuple(p.shape), step, torch.float64)
            if step == bad_step and name == "square":
                # The last row lives on rank 1 only; the square matrix's basis is rank 0's job.
                grad[-1, 0] = float("nan")
            p.grad = _shard(grad)
        before = {k: p.to_local().clone() for k, p in params.items()}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            warned.extend(str(w.message) for w in caught)
        except NonFiniteGradientError as err:
            outcome = f"raised: {err}"
    unchanged = all(torch.equal(before[k], p.to_local()) for k, p in params.items())
    steps = [int(optimizer.state[params[k]]["step"]) for k in SHAPES]
    return {"outcome": outcome, "unchanged": unchanged, "steps": steps, "warned": warned}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["skip", "error"])
@pytest.mark.parametrize("bad_step", [1, GAP])
def test_fsdp2_nonfinite_row_on_one_rank_stops_every_rank(tmp_path, mode, bad_step):
    """A NaN in rows that only rank 1 holds, on an ordinary step (seen by the reduced
    finiteness flags) or on a refresh step (seen by rank 0, which gathers that gradient for
    its SVD): both ranks skip (or both raise, naming the parameter) and
    change nothing; neither hangs in a collective the other never joins."""
    results = run_ranks(_nonfinite_worker, 2, tmp_path, mode, bad_step, timeout=50)
    for result in results:
        assert result["unchanged"]
        assert result["steps"] == [bad_step] * 3
        if mode == "error":
            assert result["outcome"].startswith("raised") and "shape (7, 7)" in result["outcome"]
            # rank 0's rows are finite: it was told "too large for its dtype"
            assert "raised: non-finite gradient in" in result["outcome"]
        else:
            assert result["outcome"] == "stepped"
            assert any(w.startswith("non-finite gradient in") for w in result["warned"]), result["warned"]


def _empty_shard_worker(rank: int, world: int, mode: str) -> str:
    param = torch.nn.Parameter(_shard(torch.ones(1, 16, dtype=torch.float64)))  # rank 1 holds no row
    optimizer = FiraAdamW([{"params": [param], "rank": None}], lr=0.01, nonfinite=mode)
    grad = torch.ones(1, 16, dtype=torch.float64)
    grad[0, 0] = float("nan")
    param.grad = _shard(grad)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
    except NonFiniteGradientError as err:
        return f"raised: {err}"
    return "; ".join(str(w.message) for w in caught)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["skip", "error"])
def test_fsdp2_nonfinite_gradient_of_a_parameter_with_an_empty_shard(tmp_path, mode):
    """The rank without rows crashed on max() of its empty shard while the other skipped, and
    the job hung; now both say the same."""
    for outcome in run_ranks(_empty_shard_worker, 2, tmp_path, mode, timeout=50):
        assert ("raised: " if mode == "error" else "") + "non-finite gradient in" in outcome, outcome



class _CountCollectives:
    """Patch torch.distributed's all_reduce / gather / broadcast to record element counts."""

    NAMES = ("all_reduce", "gather", "broadcast", "all_gather", "all_gather_into_tensor")

    def __enter__(self):
        import torch.distributed as dist

        self.calls: dict[str, list[int]] = {name: [] for name in self.NAMES}
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, self.saved[name]))
        return self

    def _wrap(self, name, fn):
        def counted(tensor, *args, **kwargs):
            self.calls[name].append(tensor.numel() if isinstance(tensor, torch.Tensor) else -1)
            return fn(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        return False


def _communication_worker(rank: int, world: int) -> dict:
    params = {k: torch.nn.Parameter(_shard(v)) for k, v in _initial(torch.float64).items()}
    optimizer = _optimizer(params, {})
    calls = []
    for step in range(GAP + 1):  # steps 0 and GAP refresh
        for name, p in params.items():
            p.grad = _shard(_gradient(name, tuple(p.shape), step, torch.float64))
        with _CountCollectives() as counter:
            optimizer.step()
        calls.append(counter.calls)
    return {"calls": calls}


@pytest.mark.timeout(60)
def test_fsdp2_ordinary_step_communicates_only_small_reductions(tmp_path):
    """Counted, not guessed: an ordinary step moves R of the left matrix (r x n) with one
    finiteness flag per gradient, the left matrix's n column norms, and ||S||^2 and
    ||phi G||^2 (the check of the subtraction's precision) of the right and square matrices:
    three all-reduces whatever the number of matrices; no gather, no broadcast. A refresh step
    adds one gather and one broadcast per rank. The first step adds one flag per plain parameter
    (is its gradient all zero on every shard?)."""
    results = run_ranks(_communication_worker, 2, tmp_path, timeout=50)
    n_left = SHAPES["left"][1]
    n_checks = len(SHAPES) + len(PLAIN_SHAPES)
    expected_all_reduce = sorted([RANK * n_left + n_checks, n_left, 2 * 2])
    for result in results:
        for step, calls in enumerate(result["calls"]):
            refresh = step % GAP == 0
            first = [len(PLAIN_SHAPES)] if step == 0 else []
            assert sorted(calls["all_reduce"]) == sorted(expected_all_reduce + first), (step, calls)
            assert calls["all_gather"] == [] and calls["all_gather_into_tensor"] == []
            assert len(calls["gather"]) == (2 if refresh else 0), (step, calls)
            assert len(calls["broadcast"]) == (2 if refresh else 0), (step, calls)
        # What a refresh moves: each gradient's rows once (plus a left projection's previous
        # basis rows after the first refresh), never the full gradient to every rank.
        first, later = result["calls"][0]["gather"], result["calls"][GAP]["gather"]
        rows = {k: -(-m // 2) for k, (m, _) in SHAPES.items()}  # padded rows per rank
        # jobs 0, 2 (left, square) go to rank 0; job 1 (right) to rank 1
        assert first == [rows["left"] * 12 + rows["square"] * 7, rows["right"] * 6]
        assert later == [rows["left"] * (12 + RANK) + rows["square"] * 7, rows["right"] * 6]


def _split_refresh_worker(rank: int, world: int, stagger: bool, align_signs: bool, dtype: torch.dtype) -> dict:
    # DDP's situation: plain tensors, the same gradient on every rank.
    import fira_optim.projection as projection

    params = {k: torch.nn.Parameter(v) for k, v in _initial(dtype).items()}
    svds = []
    real_svd = projection.torch.linalg.svd

    def counting_svd(a, *args, **kwargs):
        svds.append(tuple(a.shape))
        return real_svd(a, *args, **kwargs)

    projection.torch.linalg.svd = counting_svd
    try:
        optimizer = _optimizer(params, {"split_refresh": True, "stagger": stagger, "align_signs": align_signs})
        for step in range(STEPS):
            for name, p in params.items():
                p.grad = _gradient(name, tuple(p.shape), step, dtype)
            optimizer.step()
    finally:
        projection.torch.linalg.svd = real_svd
    return {"params": {k: p.detach() for k, p in params.items()}, "svds": svds}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stagger, align_signs, dtype", [
    (False, False, torch.float64), (True, False, torch.float64), (False, True, torch.float64),
    (False, False, torch.bfloat16),
])
def test_split_refresh_shares_svds_and_matches_one_process(tmp_path, stagger, align_signs, dtype):
    """DDP split refresh: each rank runs only its share of the SVDs, and both ranks end
    bitwise equal to the one-process run (the owner's basis is broadcast exactly: in fp32
    for bf16 weights, whose gradients stay bf16 until a projector converts them)."""
    results = run_ranks(_split_refresh_worker, 2, tmp_path, stagger, align_signs, dtype, timeout=50)
    ref_params, _ = _reference({"stagger": stagger, "align_signs": align_signs, "dtype": dtype})
    for result in results:
        for name, value in ref_params.items():
            assert torch.equal(result["params"][name], value), name
    # Matrix i belongs to rank i % 2 (left, square -> 0; right -> 1). Without stagger all
    # three refresh at steps 0, 3, 6; with it each refreshes at steps i, i + 3 (and all at 0):
    # either way rank 0 runs 6 SVDs and rank 1 runs 3, instead of 9 each.
    assert [len(r["svds"]) for r in results] == [6, 3]
    if align_signs:  # svd_basis(fast_route): the wide 5 x 12 and the tall 13 x 6 gradient, projected
        # on their small side, are decomposed through the R factor of their tall orientation's QR
        assert set(results[0]["svds"]) == {(5, 5), (7, 7)} and set(results[1]["svds"]) == {(6, 6)}
    else:  # raw signs: the plain SVD of each gradient, as Algorithm 1 and the released code
        assert set(results[0]["svds"]) == {(5, 12), (7, 7)} and set(results[1]["svds"]) == {(13, 6)}


def _fsdp1_worker(rank: int, world: int, use_orig_params: bool) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel

    import fira_optim

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = FullyShardedDataParallel(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    messages = []
    for build in (
        lambda: FiraAdamW([{"params": list(model.parameters()), "rank": 2}]),
        lambda: FiraAdamW(fira_optim.param_groups(model, rank=2)),
        lambda: FiraAdamW(fira_optim.divide_params(model, ["0", "2"], rank=2)),
    ):
        try:
            build()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_flat_parameters_are_rejected_with_a_clear_error(tmp_path, use_orig_params):
    """FSDP1 flattens weights into 1-D shards: projecting them would be silently wrong math
    (or silently no projection); every entry point says so and points at FSDP2."""
    results = run_ranks(_fsdp1_worker, 2, tmp_path, use_orig_params, timeout=50)
    for messages in results:
        for message in messages:
            assert "FSDP1" in message and "fully_shard" in message, message


def _hsdp_worker(rank: int, world: int) -> dict:
    """HSDP: a 2 x 2 mesh, replicated over dim 0, rows sharded over dim 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))

    def shard(t):
        return distribute_tensor(t, mesh, [Replicate(), Shard(0)], src_data_rank=None)

    params = {k: torch.nn.Parameter(shard(v)) for k, v in _initial(torch.float64).items()}
    _train(params, {"projector": "randomized"},
           lambda n, s, t: shard(_gradient(n, s, t, torch.float64)))
    return {"shard_index": mesh.get_local_rank(1),
            "local": {k: p.to_local().detach().clone() for k, p in params.items()}}


@pytest.mark.timeout(90)
def test_hsdp_two_dimensional_mesh_equals_one_process(tmp_path):
    """Rows sharded over one mesh dimension and replicated over the other (HSDP): the
    reductions run over the shard dimension only, and every replica ends equal to the
    one-process run."""
    results = run_ranks(_hsdp_worker, 4, tmp_path, timeout=80)
    ref_params, _ = _reference({"projector": "randomized"})
    assert sorted(r["shard_index"] for r in results) == [0, 0, 1, 1]
    for result in results:
        for name, full in ref_params.items():
            expected = full.chunk(2)[result["shard_index"]]
            torch.testing.assert_close(result["local"][name], expected, rtol=1e-9, atol=1e-11, msg=name)


def _rounding_worker(rank: int, world: int) -> dict:
    """bf16 weights, updated with stochastic rounding, whose two row blocks (one per rank) hold
    the same values and gradients: a matrix projected at rank 4, and a plain vector."""
    g = torch.Generator().manual_seed(7)
    halves = {"matrix": (16, 24), "vector": (16,)}
    values = {k: torch.randn(s, generator=g) for k, s in halves.items()}
    grads = {k: torch.randn(s, generator=g) for k, s in halves.items()}
    twice = {k: torch.cat([v, v]).bfloat16() for k, v in values.items()}
    params = {k: torch.nn.Parameter(_shard(v)) for k, v in twice.items()}
    opt = FiraAdamW([{"params": [params["matrix"]], "rank": 4, "update_proj_gap": 100},
                     {"params": [params["vector"]]}], lr=1e-3, stochastic_rounding=True)
    for _ in range(3):
        for k, p in params.items():
            p.grad = _shard(torch.cat([grads[k], grads[k]]).bfloat16())
        opt.step()
    out = {k: p.to_local().detach().float() for k, p in params.items()}
    # Plain parameters of other placements: a replica rounds as every other replica (they stay
    # equal), a column shard with its own bits.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    columns = torch.randn(4, 8, generator=g)
    others = {"replicated": (torch.randn(16, generator=g).bfloat16(), [Replicate()]),
              "columns": (torch.cat([columns, columns], dim=1).bfloat16(), [Shard(1)])}
    placed = {k: torch.nn.Parameter(distribute_tensor(v.clone(), _mesh(), pl, src_data_rank=None))
              for k, (v, pl) in others.items()}
    opt = FiraAdamW([{"params": list(placed.values())}], lr=1e-3, stochastic_rounding=True)
    for step in range(3):
        for k, param in placed.items():
            grad = torch.randn(others[k][0].shape, generator=torch.Generator().manual_seed(step)).bfloat16()
            if k == "columns":
                grad = torch.cat([grad[:, :8], grad[:, :8]], dim=1)
            param.grad = distribute_tensor(grad, _mesh(), others[k][1], src_data_rank=None)
        opt.step()
    out.update({k: p.to_local().detach().float() for k, p in placed.items()})
    out["replicated moved"] = not torch.equal(placed["replicated"].to_local(), others["replicated"][0])
    return out


@pytest.mark.timeout(120)
def test_fsdp2_shards_round_with_their_own_bits(tmp_path):
    """Each rank's rows draw their own rounding noise (they drew the same: the first numbers of
    one stream), as the rows of one process's parameter do; so do column shards, and replicas
    draw the same bits (they stay equal)."""
    first, second = run_ranks(_rounding_worker, 2, tmp_path, timeout=100)
    for name in ("matrix", "vector", "columns"):
        assert first[name].shape == second[name].shape
        assert (first[name] != second[name]).float().mean() > 0.1, name  # was 0: identical bits
    assert torch.equal(first["replicated"], second["replicated"]) and first["replicated moved"]


def _state_rounding_worker(rank: int, world: int) -> dict:
    """bf16 states written by stochastic rounding, of parameters whose two row blocks (one per
    rank) hold the same values and gradients: a right projection (the moments of R = G Q follow
    the rows), a left one (those of R = P^T G are replicated) and a plain vector."""
    g = torch.Generator().manual_seed(8)
    halves = {"right": (16, 12), "left": (4, 24), "vector": (16,)}
    values = {k: torch.randn(s, generator=g) for k, s in halves.items()}
    grads = {k: [torch.randn(s, generator=g) for _ in range(3)] for k, s in halves.items()}
    params = {k: torch.nn.Parameter(_shard(torch.cat([v, v]))) for k, v in values.items()}
    opt = FiraAdamW([{"params": [params["right"], params["left"]], "rank": 2, "update_proj_gap": 100},
                     {"params": [params["vector"]]}], lr=1e-3, state_dtype="bfloat16", state_rounding="stochastic")
    for step in range(3):
        for k, p in params.items():
            p.grad = _shard(torch.cat([grads[k][step], grads[k][step]]))
        opt.step()
    return {k: {key: opt.state[p][key].to_local().clone() for key in ("exp_avg", "exp_avg_sq")}
            for k, p in params.items()}


@pytest.mark.timeout(120)
def test_fsdp2_state_shards_round_with_their_own_bits_and_replicas_with_the_same(tmp_path):
    """state_rounding="stochastic": a moment sharded with its parameter's rows draws per shard (its
    block's offset enters the seed), one replicated on every rank the same bits on each (the
    replicas stay equal)."""
    first, second = run_ranks(_state_rounding_worker, 2, tmp_path, timeout=100)
    for key in ("exp_avg", "exp_avg_sq"):
        assert first["left"][key].dtype == torch.bfloat16 and torch.equal(first["left"][key], second["left"][key])
        for name in ("right", "vector"):
            a, b = first[name][key], second[name][key]
            # all equal if both drew one stream
            assert a.shape == b.shape and (a != b).float().mean() > 0.1, (name, key)


def _copied_plain_worker(rank: int, world: int) -> dict:
    """A plain (unprojected) parameter stepped through an fp32 copy, three steps, per config."""
    out = {}
    for name, dtype, options in COPIED_PLAIN:
        param = torch.nn.Parameter(_shard(torch.linspace(-1, 1, 9).to(dtype)))
        opt = FiraAdamW([{"params": [param]}], lr=1e-2, **options)
        for step in range(3):
            param.grad = _shard(_gradient("bias", (9,), step, dtype))
            opt.step()
        out[name] = param.to_local().detach().clone()
    return out


#: Plain parameters whose update goes through an fp32 copy written back to the parameter.
COPIED_PLAIN = [("bf16-states", torch.bfloat16, {"state_dtype": "bfloat16"}),
                ("fp16", torch.float16, {}),
                ("bf16-rounding", torch.bfloat16, {"stochastic_rounding": True}),
                ("bf16-states-stochastic", torch.bfloat16, {"state_dtype": "bfloat16", "state_rounding": "stochastic"})]


@pytest.mark.timeout(120)
def test_fsdp2_plain_parameters_stepped_through_fp32_copies_are_updated(tmp_path):
    """Each rank's rows of a bf16 or fp16 plain parameter are what one process gives (they were
    never written back: a DTensor's data_ptr() is 0, so the copy looked like the parameter);
    with stochastic rounding (of the weights or of the states) the first rank's block draws the
    one-process stream's bits."""
    results = run_ranks(_copied_plain_worker, 2, tmp_path, timeout=100)
    for name, dtype, options in COPIED_PLAIN:
        param = torch.nn.Parameter(torch.linspace(-1, 1, 9).to(dtype))
        opt = FiraAdamW([{"params": [param]}], lr=1e-2, **options)
        for step in range(3):
            param.grad = _gradient("bias", (9,), step, dtype)
            opt.step()
        first, second = param.detach().chunk(2)
        assert not torch.equal(param.detach(), torch.linspace(-1, 1, 9).to(dtype)), name
        assert torch.equal(results[0][name], first), name
        if "rounding" not in name and "stochastic" not in name:  # rank 1 rounds with its own bits (other tests)
            assert torch.equal(results[1][name], second), name
        else:
            assert not torch.equal(results[1][name], torch.linspace(-1, 1, 9).to(dtype).chunk(2)[1])


def _chunked_plain_worker(rank: int, world: int) -> dict:
    """A plain 9 x 300 parameter stepped through fp32 copies, per config: its row block on this
    rank stepped whole and CHUNK (256) elements at a time, and how many chunked steps ran."""
    from fira_optim import precision, unprojected

    chunked_steps = []
    real = unprojected._step_in_chunks
    unprojected._step_in_chunks = lambda *args, **kwargs: chunked_steps.append(1) or real(*args, **kwargs)
    out = {}
    for name, dtype, options in COPIED_PLAIN:
        for chunk in (1 << 20, 256):
            precision.CHUNK = chunk
            param = torch.nn.Parameter(_shard(torch.linspace(-1, 1, 2700).view(9, 300).to(dtype)))
            opt = FiraAdamW([{"params": [param]}], lr=1e-2, **options)
            for step in range(3):
                param.grad = _shard(_gradient("table", (9, 300), step, dtype))
                opt.step()
            out[name, chunk] = param.to_local().detach().clone()
            out[name, chunk, "state"] = [opt.state[param][key].to_local().clone() for key in ("exp_avg", "exp_avg_sq")]
    out["chunked_steps"] = len(chunked_steps)
    return out


@pytest.mark.timeout(120)
def test_fsdp2_plain_parameters_step_their_row_blocks_a_chunk_at_a_time(tmp_path):
    """Under FSDP2 a plain parameter stepped through fp32 copies goes a chunk at a time over this
    rank's rows, as a parameter does in one process (it was copied to fp32 whole): bit for bit the
    whole block's step, stochastic rounding's bits included, on each rank."""
    for result in run_ranks(_chunked_plain_worker, 2, tmp_path, timeout=100):
        assert result["chunked_steps"] == 3 * len(COPIED_PLAIN)  # 1500 and 1200 elements: over 256
        for name, dtype, _ in COPIED_PLAIN:
            assert result[name, 256].dtype == dtype
            assert torch.equal(result[name, 256], result[name, 1 << 20]), name
            for chunked, whole in zip(result[name, 256, "state"], result[name, 1 << 20, "state"]):
                assert torch.equal(chunked, whole), name


def _zero_rows_first(step: int) -> torch.Tensor:
    """A 9-row embedding's gradient whose rows 0-4 (rank 0's shard of two) are zero at step 0:
    a table whose first batch uses only tokens 5-8."""
    grad = _gradient("embedding", (9, 4), step, torch.float64)
    if step == 0:
        grad[:5] = 0
    return grad


def _zero_shard_worker(rank: int, world: int, dim: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(t):  # rows (FSDP2's layout) or columns (a shard_placement_fn, tensor parallelism)
        t = t if dim == 0 else t.T.contiguous()
        return distribute_tensor(t, _mesh(), [Shard(dim)], src_data_rank=None)

    param = torch.nn.Parameter(shard(torch.linspace(-1, 1, 36, dtype=torch.float64).view(9, 4)))
    opt = FiraAdamW([{"params": [param], "rank": None}], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        param.grad = shard(_zero_rows_first(step))
        opt.step()
    block = param.to_local().detach().clone()
    return {"rows": block if dim == 0 else block.T, "step": float(opt.state[param]["step"])}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dim", [0, 1])
def test_fsdp2_plain_parameter_zero_on_one_shard_steps_on_every_rank(tmp_path, dim):
    """Whether a plain parameter's gradient is all zero (before its first real step) is decided
    over every shard: a rank whose rows were zero stepped nothing and fell a step behind."""
    results = run_ranks(_zero_shard_worker, 2, tmp_path, dim, timeout=100)
    param = torch.nn.Parameter(torch.linspace(-1, 1, 36, dtype=torch.float64).view(9, 4))
    opt = FiraAdamW([{"params": [param], "rank": None}], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        param.grad = _zero_rows_first(step)
        opt.step()
    assert float(opt.state[param]["step"]) == 3.0
    for result, rows in zip(results, param.detach().chunk(2)):
        assert result["step"] == 3.0
        torch.testing.assert_close(result["rows"], rows, rtol=1e-12, atol=1e-12)
