"""Scaling-factor similarity: the recorded factors are the ones the optimizers apply."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import fira_optim
from fira_train.analysis.similarity import (
    FACTORS_FILE,
    ScalingFactorRecorder,
    ShadowAdam,
    average,
    compare_factors,
    null_pairs,
    projected_matrices,
    run_similarity,
    sampled_columns,
    scaling_factors,
    similarity,
)
from fira_train.files import read_json_lines
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401

LR, ALPHA = 0.01, 0.25


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 12))


def _steps(model, optimizer, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` steps on random data; the weights before the last step, and its gradients."""
    x, y = torch.randn(64, 24), torch.randn(64, 12)
    for _ in range(n):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x + 0.1 * torch.randn_like(x)), y).backward()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
    return before


@pytest.mark.parametrize("level", ["matrix", "column"])
def test_fira_factors_equal_the_factors_fira_applies(level: str) -> None:
    # With only_scaling and no limiter Fira's update is alpha * phi * G, so phi can be read off
    # the weight change and must equal what the recorder computes from the optimizer state.
    model = _model()
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=5, alpha=ALPHA), lr=LR,
                                     only_scaling=True, limiter="none", scaling=level)
    before = _steps(model, optimizer, 3)
    group = optimizer.param_groups[0] if optimizer.param_groups[0]["rank"] else optimizer.param_groups[1]
    for name, p in projected_matrices(model).items():
        matrix, column, side = scaling_factors(name, p, optimizer.state[p], group)
        applied = (before[name] - p.detach()) / (LR * ALPHA)
        dim = fira_optim.projection.reduce_dim(side)
        if level == "matrix":
            assert matrix == pytest.approx(float(applied.norm() / p.grad.norm()), rel=1e-4)
        else:
            expected = torch.linalg.vector_norm(applied, dim=dim) / torch.linalg.vector_norm(p.grad, dim=dim)
            torch.testing.assert_close(column, expected, rtol=1e-4, atol=0)


def test_adam_factors_equal_the_factors_adam_applies() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    before = _steps(model, optimizer, 3)
    for name, p in projected_matrices(model).items():
        matrix, column, side = scaling_factors(name, p, optimizer.state[p], optimizer.param_groups[0])
        applied = (before[name] - p.detach()) / LR  # psi(G)
        assert matrix == pytest.approx(float(applied.norm() / p.grad.norm()), rel=1e-4)
        dim = fira_optim.projection.reduce_dim(side)
        torch.testing.assert_close(column, torch.linalg.vector_norm(applied, dim=dim)
                                   / torch.linalg.vector_norm(p.grad, dim=dim), rtol=1e-4, atol=0)


def test_similarity_metrics() -> None:
    x = np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    same = similarity(x, 2 * x)
    assert same["cosine"] == pytest.approx(1.0)
    assert same["spearman"] == pytest.approx(1.0) and same["kendall"] == pytest.approx(1.0)
    assert same["pearson"] == pytest.approx(1.0) and same["pearson_p"] < 0.01
    assert same["rel_mse"] == pytest.approx(0.25)
    assert same["mse"] == pytest.approx(np.mean(x ** 2)) and same["distance"] == pytest.approx(np.linalg.norm(x))
    reverse = similarity(x, x[::-1].copy())
    assert reverse["spearman"] == pytest.approx(-0.3)  # ranks 1 3 2 5 4 vs 4 5 2 3 1
    with pytest.raises(ValueError, match="same length"):
        similarity(x, x[:3])


def test_sampled_columns_are_fixed_by_name_and_seed() -> None:
    a = sampled_columns("layers.0.q_proj.weight", 256, 100, seed=0)
    assert len(a) == 100 == len(set(a)) and a == sorted(a) and max(a) < 256
    assert a == sampled_columns("layers.0.q_proj.weight", 256, 100, seed=0)
    assert a != sampled_columns("layers.0.k_proj.weight", 256, 100, seed=0)
    assert a != sampled_columns("layers.0.q_proj.weight", 256, 100, seed=1)
    assert sampled_columns("x", 64, 100, seed=0) == list(range(64))
    with pytest.raises(ValueError, match="every"):
        ScalingFactorRecorder("unused.jsonl", every=0)


def test_shadow_adam_equals_torch_adamw_on_the_same_gradients() -> None:
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(6, 9))
    adam = torch.optim.AdamW([p], lr=LR, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    shadow = ShadowAdam()
    for _ in range(4):
        p.grad = torch.randn(6, 9)
        adam.step()
        shadow.update("w", p.grad, (0.8, 0.95))
    expected_matrix, expected_column, side = scaling_factors("w", p, adam.state[p], adam.param_groups[0])
    matrix, column = shadow.factors("w", p.grad, (0.8, 0.95), 1e-6, side)
    assert matrix == pytest.approx(expected_matrix, rel=1e-5)
    torch.testing.assert_close(column, expected_column, rtol=1e-5, atol=0)
    assert shadow.factors("unseen", p.grad, (0.8, 0.95), 1e-6, side) is None


def test_recorder_shadow_factors_are_full_rank_adams_on_the_fira_runs_gradients(tmp_path: Path) -> None:
    # The Fira run's gradients also drive a full-rank AdamW on a copy of the model: the
    # recorder's full-rank factors must be that AdamW's, step by step, while its low-rank
    # factors stay Fira's own; the shadow is fed at every step, recorded or not.
    model = _model()
    betas, eps = (0.9, 0.999), 1e-8
    fira = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=5, alpha=ALPHA), lr=LR, betas=betas, eps=eps)
    twin = copy.deepcopy(model)
    adam = torch.optim.AdamW(twin.parameters(), lr=LR, betas=betas, eps=eps, weight_decay=0.0)
    path = tmp_path / FACTORS_FILE
    recorder = ScalingFactorRecorder(path, every=2, columns=3, seed=0, shadow=True)
    x, y = torch.randn(64, 24), torch.randn(64, 12)
    expected: dict[int, dict[str, tuple]] = {}
    for step in range(1, 6):
        fira.zero_grad()
        torch.nn.functional.mse_loss(model(x + 0.1 * torch.randn_like(x)), y).backward()
        fira.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad.clone()
        adam.step()
        recorder.after_step(step, model, fira, 0.0)
        if step in (1, 2, 4):
            expected[step] = {name: scaling_factors(name, q, adam.state[q], adam.param_groups[0])
                              for name, q in projected_matrices(twin).items()}
    records = read_json_lines(path)
    assert [r["step"] for r in records] == [1, 2, 4]
    group = next(g for g in fira.param_groups if g["rank"] is not None)
    for record in records:
        assert set(record["full_matrix"]) == set(record["matrix"]) == set(projected_matrices(model))
        for name, (matrix, column, _) in expected[record["step"]].items():
            index = sampled_columns(name, column.numel(), 3, 0)
            assert record["full_matrix"][name] == pytest.approx(matrix, rel=1e-5)
            np.testing.assert_allclose(record["full_column"][name], column[index].numpy(), rtol=1e-5)
    p = dict(model.named_parameters())["0.weight"]  # the last record's low-rank factor is Fira's own
    low = scaling_factors("0.weight", p, fira.state[p], group)
    assert records[-1]["step"] == 4 and low[0] != records[-1]["full_matrix"]["0.weight"]


def _synthetic_records(steps: int, scale: float = 3.0) -> list[dict]:
    """Records whose full-rank factors are ``scale`` times the low-rank ones, matrices of
    different sizes and scales: every paired statistic is perfect, the nulls are not."""
    rng = np.random.default_rng(0)
    records = []
    for step in range(1, steps + 1):
        matrix = {f"m{i}": float(rng.uniform(0.5, 2.0)) for i in range(12)}
        column = {name: (phi * rng.uniform(0.2, 5.0, size=8)).tolist() for name, phi in matrix.items()}
        records.append({"step": step, "matrix": matrix, "column": column,
                        "full_matrix": {n: scale * v for n, v in matrix.items()},
                        "full_column": {n: [scale * c for c in v] for n, v in column.items()}})
    return records


def test_null_pairs_break_the_pairing_and_keep_the_values() -> None:
    record = _synthetic_records(1)[0]
    names = sorted(record["matrix"])
    low = {"matrix": record["matrix"], "column": record["column"]}
    full = {"matrix": record["full_matrix"], "column": record["full_column"]}
    pairs = null_pairs(low, full, names, np.random.default_rng(0))
    assert set(pairs) == {"null_matrix", "null_column", "null_column_within"}
    x, y = pairs["null_matrix"]
    np.testing.assert_allclose(x, [record["matrix"][n] for n in names])
    np.testing.assert_allclose(np.sort(y), np.sort([record["full_matrix"][n] for n in names]))
    assert not np.allclose(y, [record["full_matrix"][n] for n in names])
    x, y = pairs["null_column_within"]  # each matrix's block holds that matrix's own columns
    for i, n in enumerate(names):
        np.testing.assert_allclose(np.sort(y[8 * i:8 * i + 8]), np.sort(record["full_column"][n]))
    x, y = pairs["null_column"]
    np.testing.assert_allclose(np.sort(y), np.sort(np.concatenate([record["full_column"][n] for n in names])))


def test_compare_factors_measured_against_its_nulls() -> None:
    results = compare_factors(_synthetic_records(40), seed=0)
    assert set(results) == {"matrix", "column", "null_matrix", "null_column", "null_column_within"}
    averages = {key: average(steps) for key, steps in results.items()}
    for level in ("matrix", "column"):
        assert averages[level]["cosine"] == pytest.approx(1.0) and averages[level]["spearman"] == pytest.approx(1.0)
        assert averages[level]["rel_mse"] == pytest.approx((2 / 3) ** 2)  # (3x - x)^2 / (3x)^2
    # the nulls: positive factors keep a high cosine without any pairing, the rank
    # correlations fall to about 0, and the relative MSE hardly moves
    assert 0.8 < averages["null_matrix"]["cosine"] < 0.99
    assert abs(averages["null_matrix"]["spearman"]) < 0.15 and abs(averages["null_column"]["spearman"]) < 0.1
    assert averages["null_matrix"]["rel_mse"] > averages["matrix"]["rel_mse"]
    # within matrices the matrix scales still pair up: more rank correlation than a full shuffle
    assert averages["null_column_within"]["spearman"] > averages["null_column"]["spearman"] + 0.05
    assert results["null_matrix"] == compare_factors(_synthetic_records(40), seed=0)["null_matrix"]  # reproducible
    with pytest.raises(ValueError, match="shadow"):
        compare_factors([{"step": 1, "matrix": {"a": 1.0, "b": 2.0}, "column": {"a": [1.0], "b": [2.0]}}])


def test_similarity_analysis_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4")
    out = tmp_path / "similarity"
    result = run_similarity(config, out, ranks=(8, 32), every=2, columns=10)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["fira-r32", "fira-r8"]  # no separate AdamW run
    low = read_json_lines(out / "fira-r8" / FACTORS_FILE)
    assert [r["step"] for r in low] == [1, 2, 4]
    assert len(low[0]["matrix"]) == len(low[0]["full_matrix"]) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(len(v) == 10 for v in low[0]["full_column"].values())
    # at step 1 Adam's psi is ~sign(G), so the full-rank matrix factor is sqrt(numel) / ||G||
    # -- and differs from the rank-8 one computed on the same gradient
    assert low[0]["full_matrix"] != low[0]["matrix"]
    for name, factor in low[0]["full_matrix"].items():
        assert factor > low[0]["matrix"][name]
    for rank in (8, 32):
        for key in ("matrix", "column", "null_matrix", "null_column", "null_column_within"):
            avg = result["averages"][rank][key]
            assert avg["steps"] == 3 and 0 < avg["cosine"] <= 1 and -1 <= avg["spearman"] <= 1
            assert 0 <= avg["spearman_p"] <= 1
    text = result["report"].read_text()
    assert "r/d_model = 8/64" in text and "0.9922" in text and "Kendall" in text
    assert "null, 8/64: matrices / columns shuffled" in text and "shadow Adam" in text
    assert "columns shuffled within each matrix" in text and "different learning rates" not in text
    assert "for the 14 projected matrices (a matrix whose smaller side" in text and "(140 columns in all)" in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="step_in_backward"):
        run_similarity(analysis_config(corpus_root, tmp_path / "run", "optim.step_in_backward=true"), out)


def test_a_rank_at_a_matrix_s_smaller_side_compares_fewer_matrices_and_says_so(tmp_path: Path,
                                                                               corpus_root: Path) -> None:
    """One key/value head: k_proj and v_proj are 32 x 64, trained as plain Adam at rank 32."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2", "model.num_key_value_heads=1")
    result = run_similarity(config, tmp_path / "similarity", ranks=(8, 32), every=1, columns=10)
    names = {r: set(read_json_lines(tmp_path / "similarity" / f"fira-r{r}" / FACTORS_FILE)[0]["matrix"]) for r in (8, 32)}
    assert len(names[8]) == 14 and names[32] == {n for n in names[8] if "k_proj" not in n and "v_proj" not in n}
    text = result["report"].read_text()
    assert "for the projected matrices (14 at r = 8, 10 at r = 32; a matrix whose smaller side" in text
    assert "(columns in all: 140 at r = 8, 100 at r = 32)" in text


def test_the_report_names_the_steps_it_recorded(tmp_path: Path, corpus_root: Path) -> None:
    """A run shorter than --every read "recorded ... every 10 steps (and at step 1)" and "values
    are averages over the recorded steps": it recorded step 1 alone, which nothing said."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3")
    text = run_similarity(config, tmp_path / "similarity", ranks=(8,), every=10, columns=10)["report"].read_text()
    assert "Factors recorded after the optimizer step every 10 steps and at step 1 (step 1) for " in text


@pytest.mark.parametrize(("every", "columns", "flag"), [(0, 10, "--every"), (-1, 10, "--every"), (2, 0, "--columns")])
def test_similarity_refuses_bad_every_and_columns_before_any_run(tmp_path: Path, corpus_root: Path, every, columns,
                                                                  flag) -> None:
    """They were checked by the recorder, once the first run had started: after its folder was made."""
    out = tmp_path / "similarity"
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4")
    with pytest.raises(ValueError, match=f"{flag} must be an int >= 1, got {min(every, columns)}"):
        run_similarity(config, out, ranks=(8,), every=every, columns=columns)
    assert not out.exists()


def test_shadow_moments_loaded_from_a_checkpoint_follow_the_gradients_device() -> None:
    # a checkpoint loads on the CPU: on a GPU run the next update mixed devices (meta stands in)
    saved = ShadowAdam()
    saved.update("w", torch.ones(3, 2), (0.9, 0.999))
    shadow = ShadowAdam()
    shadow.load_state_dict(saved.state_dict())
    shadow.update("w", torch.ones(3, 2, device="meta"), (0.9, 0.999))
    assert shadow.state["w"]["exp_avg"].device.type == "meta" and shadow.state["w"]["step"] == 2


def _fira_factors(state_dtype: str) -> tuple[float, torch.Tensor]:
    """The factors of a 64 x 256 matrix (rank 16: R has 4096 entries, quantized in int8) after
    three Fira steps on fixed data."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False))
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=16, update_proj_gap=50), lr=1e-3,
                                     state_dtype=state_dtype)
    for step in range(3):
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    p = model[0].weight
    group = next(g for g in optimizer.param_groups if g["rank"] is not None)
    matrix, column, _ = scaling_factors("0.weight", p, optimizer.state[p], group)
    return matrix, column


def test_factors_of_int8_states_are_read_from_the_decoded_moments() -> None:
    """int8 moments are codes and per-block scales: the factors are those of the moments the
    codes stand for (within int8's rounding of fp32's), not of the codes (4x too large)."""
    exact, exact_column = _fira_factors("float32")
    coded, coded_column = _fira_factors("int8")
    assert coded == pytest.approx(exact, rel=0.05)
    torch.testing.assert_close(coded_column, exact_column, rtol=0.1, atol=0)
    assert _fira_factors("bfloat16")[0] == pytest.approx(exact, rel=0.05)


def test_the_recorder_leaves_out_matrices_the_run_trains_as_plain_adam(tmp_path: Path) -> None:
    """At a rank >= min(m, n) (a grouped-query k_proj / v_proj) Fira steps a matrix as Adam:
    its factor and the shadow's are the same number, and would inflate the similarity."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30),
                                torch.nn.Tanh(), torch.nn.Linear(30, 4))  # 4 x 30: min side 4 < rank 5
    _record_two_steps(model, tmp_path, torch.randn(16, 24), torch.randn(16, 4))
    assert "4.weight" in projected_matrices(model)  # 2-D: a projection candidate by its shape
    for record in read_json_lines(tmp_path / FACTORS_FILE):
        assert set(record["matrix"]) == set(record["full_matrix"]) == {"0.weight", "2.weight"}


def test_a_matrix_whose_first_gradient_is_zero_has_no_factor_yet(tmp_path: Path) -> None:
    model = _model()

    def zero_first(step: int) -> None:  # Fira takes no step from it: its state stays at step 0
        if step == 1:
            model[0].weight.grad.zero_()

    _record_two_steps(model, tmp_path, torch.randn(16, 24), torch.randn(16, 12), before_step=zero_first)
    first, second = read_json_lines(tmp_path / FACTORS_FILE)
    assert set(first["matrix"]) == {"2.weight"} and set(second["matrix"]) == {"0.weight", "2.weight"}


def _record_two_steps(model, tmp_path: Path, x, y, before_step=lambda step: None) -> None:
    """Two Fira steps at rank 5 on (x, y), each recorded with the shadow moments to FACTORS_FILE."""
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=5), lr=LR)
    recorder = ScalingFactorRecorder(tmp_path / FACTORS_FILE, every=1, columns=3, shadow=True)
    for step in (1, 2):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        before_step(step)
        optimizer.step()
        recorder.after_step(step, model, optimizer, 0.0)


def test_a_column_with_a_zero_gradient_is_left_out_of_its_step(tmp_path: Path) -> None:
    """0 / 0 has no factor (recorded as null): the other columns are compared without it, and a
    step without a p-value does not count as one without significance."""
    rng = np.random.default_rng(0)
    low = {f"m{i}": rng.uniform(1, 2, 6).tolist() for i in range(3)}
    full = {name: [2 * v for v in values] for name, values in low.items()}
    record = {"step": 1, "matrix": {n: float(np.mean(v)) for n, v in low.items()}, "column": low,
              "full_matrix": {n: 2 * float(np.mean(v)) for n, v in low.items()}, "full_column": full}
    holed = copy.deepcopy(record)
    holed["column"]["m0"][2] = holed["full_column"]["m0"][2] = None
    holed["full_column"]["m1"][0] = None  # undefined on one side only
    (clean,), (gap,) = compare_factors([record])["column"], compare_factors([holed])["column"]
    assert gap["cosine"] == pytest.approx(1.0) and gap["spearman"] == pytest.approx(1.0)
    assert clean["spearman"] == pytest.approx(1.0)
    kept = [v for n in sorted(low) for i, v in enumerate(low[n]) if (n, i) not in {("m0", 2), ("m1", 0)}]
    assert gap["distance"] == pytest.approx(float(np.linalg.norm(kept)))  # |low - 2 low| over the kept ones
    summary = average([{"step": 1, "spearman": 0.9, "spearman_p": 0.01},
                       {"step": 2, "spearman": float("nan"), "spearman_p": float("nan")}])
    assert summary["spearman_significant"] == 1.0 and summary["steps"] == 2.0


def test_the_mean_factor_leaves_out_factors_that_could_not_be_computed() -> None:
    """A zero gradient column's factor is 0 / 0, recorded as NaN (null once read back): the
    report's mean factor, and its low/full ratio, read nan."""
    from fira_train.analysis.similarity import _mean_factor

    records = [{"matrix": {"a": 1.0, "b": float("nan")}}, {"matrix": {"a": 3.0, "b": None}},
               {"matrix": {"a": [2.0, float("nan")]}}]
    assert _mean_factor(records, "matrix") == 2.0
    assert math.isnan(_mean_factor([{"matrix": {"a": float("nan")}}], "matrix"))
