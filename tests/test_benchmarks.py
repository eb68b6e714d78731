"""The benchmark scripts run (on the micro recipe): their numbers are committed in docs/, so a
script that no longer runs would leave those numbers unreproducible."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fira_train.harness_fixtures import write_corpus
from tests.process_watch import ended, needs_proc, parent_and_pid, wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_throughput_script_times_every_method_on_the_same_batches(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "throughput.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--recipe", "micro",
               "--methods", "adamw,fira,galore@optim.rank=8", "--rounds", "2", "--threads", "1",
               "--out", str(out), f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
               "data.vocab_size=300", "data.val_fraction=0.1", "train.progress=false"]
    subprocess.run(command, check=True, cwd=ROOT, timeout=280, capture_output=True)
    result = json.loads(out.read_text())
    methods = ["adamw", "fira", "galore@optim.rank=8"]
    assert list(result["ratio_to_adamw_pooled"]) == methods
    assert result["ratio_to_adamw_pooled"]["adamw"] == 1.0
    assert result["rank"] == 16 and result["update_proj_gap"] == 5  # the micro recipe's
    assert result["ratio_to_adamw_pooled_per_round"]["adamw"] == [1.0, 1.0]
    assert all(len(v) == 2 and all(r > 0 for r in v) for v in result["ratio_to_adamw_pooled_per_round"].values())
    for method in methods:
        rounds = result["update_seconds_per_step"][method]
        assert len(rounds) == 2 and all(len(r) == result["steps_per_round"] for r in rounds)
        assert 0 < result["other_steps_seconds_median"][method] <= result["slowest_step_seconds_median"][method]


@pytest.mark.timeout(300)
def test_memory_phases_script_splits_each_step_and_counts_what_is_alive(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "phases"
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_phases.py"), "--recipe", "micro",
               "--methods", "adamw,fira@optim.step_in_backward=true", "--steps", "2", "--out", str(out),
               f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300",
               "data.val_fraction=0.1", "train.batch_size=2", "train.micro_batch_size=2"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    subprocess.run(command, check=True, cwd=ROOT, timeout=280, capture_output=True, env=env)
    record = json.loads((out / "phases.json").read_text())
    assert record["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    adamw, hooks = (row["measured"] for row in record["rows"])
    for measured in (adamw, hooks):
        assert [s["step"] for s in measured["steps"]] == [1, 2]
        for s in measured["steps"]:
            for phase in ("forward", "backward", "optimizer_step"):
                # VmHWM follows VmRSS through counters the kernel syncs every few dozen page
                # faults, so it may trail the end of a phase by a few pages
                assert s[phase]["peak"] >= max(s[phase]["start"], s[phase]["end"]) - 2**20
            assert s["forward"]["saved_for_backward"] > 0
    # AdamW's gradients are all alive after the backward pass; in-backward updates free each one
    assert adamw["steps"][0]["backward"]["gradients_after"] == adamw["weights_bytes"]
    assert hooks["steps"][0]["backward"]["gradients_after"] == 0
    # two moments per weight, and a step counter per parameter
    assert 0 < adamw["optimizer_state_bytes"] - 2 * adamw["weights_bytes"] < 4096
    assert "MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory_phases.py" in (out / "phases.md").read_text()


@pytest.mark.timeout(300)
def test_the_int8_docs_quote_the_committed_quantizer_run() -> None:
    """The speed-up over torchao and bitsandbytes' misrounded share that the docs give as the
    reason for an own kernel are the committed JSON's."""
    rows = json.loads((ROOT / "docs" / "benchmarks" / "int8_quantize.json").read_text())["rows"]
    large = [row for row in rows if row["elements"] >= 65536]
    ratios = [row["ns_per_element"]["torchao quantize"] / row["ns_per_element"]["fira_optim quantize"]
              for row in large]
    ours = [row["ns_per_element"]["fira_optim quantize"] for row in large]
    missed = [row["exactness"]["bitsandbytes"]["share_of_codes_not_nearest"] for row in rows if row["map"] == "unsigned"]
    docs = " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    assert f"{min(ratios):.0f}-{max(ratios):.0f} times torchao's speed" in docs
    assert f"{100 * min(missed):.0f}-{100 * max(missed):.0f}% of bitsandbytes' codes" in docs
    assert all(row["exactness"]["fira_optim"]["share_of_codes_not_nearest"] == 0 for row in rows)
    docstring = " ".join((ROOT / "src" / "fira_optim" / "precision.py").read_text().split())
    assert f"{min(ours):.1f}-{max(ours):.1f} ns per element, {min(ratios):.0f}-{max(ratios):.0f} times" in docstring


def test_int8_quantize_script_times_and_checks_every_quantizer(tmp_path: Path) -> None:
    """Why fira_optim quantizes with its own kernel (the docs' stated reason): the script times it
    against torchao's (and bitsandbytes', where installed) and checks every code against the
    nearest map value. Ours must be exact on both maps; bitsandbytes' is not on the unsigned one."""
    out = tmp_path / "int8.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "int8_quantize.py"), "--sizes", "4096", "65536",
               "--repeats", "1", "--out", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, timeout=280, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(row["map"], row["elements"]) for row in rows] == [
        ("signed", 4096), ("signed", 65536), ("unsigned", 4096), ("unsigned", 65536)]
    for row in rows:
        assert row["exactness"]["fira_optim"] == {"share_of_codes_not_nearest": 0.0, "max_code_difference": 0}
        assert row["exactness"]["torchao"]["max_code_difference"] <= 1
        assert all(ns > 0 for ns in row["ns_per_element"].values())
        if "bitsandbytes" in row["exactness"] and row["map"] == "unsigned":
            assert row["exactness"]["bitsandbytes"]["share_of_codes_not_nearest"] > 0.01
    result = subprocess.run([*command[:2], "--sizes", "100"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "--sizes: 100 is not a positive multiple of the block size 256" in result.stderr


def test_refresh_threads_script_times_every_configuration(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "refresh.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "refresh_threads.py"), "--recipe", "micro",
               "--rounds", "2", "--steps", "1", "--out", str(out), f"data.source={corpus}",
               f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300", "data.val_fraction=0.1",
               "train.progress=false"]
    subprocess.run(command, check=True, cwd=ROOT, timeout=280, capture_output=True)
    result = json.loads(out.read_text())
    assert result["matrices"] == 2 * 7 and result["rank"] == 16  # micro: 2 layers of 7 matrices
    names = set(result["refresh_seconds_median"])
    assert {"sequential, tall", "sequential, QR first"} <= names
    if "pool, 1 thread per worker, QR first" in names:  # 2+ torch threads
        assert len(names) == 6
    assert all(len(v) == 2 and min(v) > 0 for v in result["refresh_seconds"].values())


def test_refresh_host_takes_its_shapes_from_the_recipes() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import refresh_host
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shapes, rank = refresh_host.recipe_shapes("60m")  # hidden 512, MLP 1376, 8 layers, rank 128
    assert rank == 128 and len(shapes) == 8 * 7
    assert shapes.count((512, 512)) == 32 and shapes.count((1376, 512)) == 16 and shapes.count((512, 1376)) == 8
    assert refresh_host.recipe_shapes("tiny")[1] == 64


def test_memory_summary_reads_every_size_and_relates_to_adamw(tmp_path: Path) -> None:
    def row(method, peak, estimate, parameters):
        return {"method": method, "measured_peak_bytes": peak, "estimated_bytes": estimate,
                "measured": {"parameters": parameters}}

    for size, parameters, scale in (("small", 10**6, 1), ("big", 10**8, 4)):
        (tmp_path / size).mkdir()
        rows = [row("adamw", 2**31 * scale, 2**31 * scale, parameters),
                row("fira", 2**30 * scale, 2**29 * scale, parameters)]
        (tmp_path / size / "memory.json").write_text(json.dumps({"rows": rows}))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_summary.py"), str(tmp_path)],
                   check=True, cwd=ROOT, timeout=60, capture_output=True)
    text = (tmp_path / "summary.md").read_text()
    assert "| Method | small (1M) | big (100M) |" in text
    assert "| fira | 1.00 GiB (50%); 2.00 | 4.00 GiB (50%); 2.00 |" in text


def test_memory_reestimate_rebuilds_each_rows_config_on_its_device(tmp_path: Path) -> None:
    """Each row's estimate is recomputed from its recipe, spec and the given overrides, on the
    device it was measured on: equal to what ``measure`` wrote on the CPU, AdamW's larger on CUDA."""
    reestimate = _benchmark("memory_reestimate").reestimate
    from fira_train.config.method_spec import parse_method_specs
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import get_recipe
    from fira_train.memory.run_estimate import estimate_run_bytes

    overrides = ["train.batch_size=1", "train.micro_batch_size=1", "train.param_dtype=bfloat16"]
    base = apply_overrides(get_recipe("60m"), overrides)
    rows = []
    for method, device in (("adamw", "cpu"), ("adamw", "cuda"), ("fira", "cuda")):
        config = parse_method_specs(method)[0].config(base, ".")
        rows.append({"method": method, "measured_peak_bytes": 1,
                     "estimated_bytes": estimate_run_bytes(config, 32000)["total"],
                     "measured": {"parameters": 58 * 10**6, "vocab_size": 32000, "device": device}})
    # measure's LoRA row carries no estimate: it is left out, not estimated as full AdamW
    rows.append({"method": "lora", "measured_peak_bytes": 1, "estimated_bytes": None,
                 "measured": {"parameters": 58 * 10**6, "vocab_size": 32000, "device": "cpu"}})
    (tmp_path / "60m").mkdir()
    (tmp_path / "60m" / "memory.json").write_text(json.dumps({"recipe": "60m", "rows": rows}))
    cpu, cuda, fira = reestimate(tmp_path, overrides)
    assert cpu["now"] == cpu["then"]  # the same config rebuilt, on the same device
    adamw_config = parse_method_specs("adamw")[0].config(base, ".")
    assert cuda["now"] == estimate_run_bytes(adamw_config, 32000, "cuda")["total"] != cuda["then"]
    assert fira["now"] < fira["then"]  # on CUDA the activations are freed before the step
    assert reestimate(tmp_path, [])[0]["now"] != cpu["now"]  # the overrides are applied
    assert cpu["size"] == "60m"
    (tmp_path / "60m").rename(tmp_path / "before")  # a folder named for the measurement, not the size
    assert [r["size"] for r in reestimate(tmp_path, overrides)] == ["60m (before)"] * 3


def test_benchmarks_page_is_what_render_writes_from_the_committed_json() -> None:
    # docs/benchmarks.md quotes only numbers from docs/benchmarks/*.json: a hand edit (or a JSON
    # changed without rerendering) shows up here. Both throughput estimates are named.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert render.render() == page
    assert "median of the per-round tokens/s ratios" in page and "by the pooled estimate" in page
    assert "## Training throughput of Fira's memory options" in page
    assert "Kept run `throughput_tiny_memory_options.json`" not in page


def test_readme_quotes_the_committed_compile_times() -> None:
    """The README's compile times are the committed benchmark JSON's, rounded as it prints them
    (it had kept an earlier run's CPU figure after the page was regenerated)."""

    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"the first step compiles: ([\d.]+) s on the CPU and ([\d.]+) s on an H200", readme)
    assert quoted, "README no longer quotes the compile times: update this test"
    for text, name in zip(quoted.groups(), ("optimizer_step.json", "optimizer_step_cuda.json")):
        measured = json.loads((ROOT / "docs" / "benchmarks" / name).read_text())["compiled_first_step_s"]
        assert text == f"{measured:.1f}", name


def test_the_optimizer_docs_quote_the_committed_precision_checks() -> None:
    """The int8 embedding and residual-precision numbers in docs/optimizer.md are the committed
    JSON's (they were quoted from printouts that nothing kept)."""
    docs = " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    largest = json.loads((ROOT / "docs" / "benchmarks" / "int8_embedding_rows.json").read_text())
    largest = largest["largest_embedding_entry"]
    assert (f"{largest['int8, second moments as values']:.1f} with values, {largest['int8']:.4f} with the "
            f"square roots, {largest['float32']:.4f} with fp32 states") in docs
    steps = json.loads((ROOT / "docs" / "benchmarks" / "residual_precision.json").read_text())["steps"]
    explicit = [step for step in steps if step["explicit"]]
    first, second, after = explicit  # the first refresh, the second, and the step after it
    assert first["step"] == 1 and after["step"] == second["step"] + 1
    assert (f"{first['explicit']} of {first['matrices']} matrices at the first refresh, {second['explicit']} at the "
            f"second (median `||S|| / ||phi G||` {second['ratio_median']:.3f}, the smallest "
            f"{second['ratio_min']:.4f}; the subtraction's error there: median {100 * second['error_median']:.2f}% "
            f"of `||S||`, largest {100 * second['error_max']:.0f}%), {after['explicit']} the step after") in docs


def test_the_optimizer_docs_quote_the_committed_alpha_sweep_and_int8_cost() -> None:
    """docs/optimizer.md's alpha advice (validation and test perplexity of the alpha sweep) and the
    tokens/s cost of int8 states (also in README.md) are the committed sweep.json's and throughput
    JSON's (the cost was quoted as "about 4%" where the run gives 4.5%)."""
    docs = " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    alpha = _sweep_methods("tiny-sweep-fira-alpha")
    chosen, default = alpha["fira@optim.alpha=0.1"], alpha["fira"]
    assert chosen["chosen_lr"] == 0.05 and default["chosen_lr"] == 0.02
    assert (f"{chosen['val_ppl']['mean']:.1f} against {default['val_ppl']['mean']:.1f} validation perplexity over "
            f"three seeds; on the held-out test split {chosen['test_ppl']['mean']:.1f} against "
            f"{default['test_ppl']['mean']:.1f}, lower at every seed, but three seeds do not separate them: "
            f"{_paired(default, 2)};") in docs
    assert all(default["test_ppl_by_seed"][s] > chosen["test_ppl_by_seed"][s] for s in "012")
    low, high = default["test_ppl_minus_reference"]["ci95"]
    assert low < 0 < high
    median = json.loads((ROOT / "docs" / "benchmarks" / "throughput_tiny_memory_options.json").read_text())[
        "ratio_to_adamw_median"]
    int8, fira = median["fira@optim.state_dtype=int8"], median["fira"]
    assert (f"int8 states cost {100 * (1 - int8 / fira):.1f}% of tokens/s against plain Fira (medians of the "
            f"per-round ratios to AdamW, {100 * int8:.1f}% against {100 * fira:.1f}%), one run of 5 rounds") in docs
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"int8 states cost {100 * (1 - int8 / fira):.1f}% of tokens/s against plain Fira on `tiny` (medians of "
            "the per-round ratios to AdamW; one run of 5 rounds") in readme


@pytest.mark.parametrize(("folder", "spec", "earlier", "lr", "table"), [
    ("tiny-exact-norm", "fira", "tiny-sweep-galore-raw", 0.02, "rerun-fira.md"),
    ("tiny-exact-norm", "galore", "tiny-sweep-galore-raw", 0.02, "rerun-galore.md"),
    ("tiny-exact-norm", "adamw", "tiny-sweep", 0.001, "rerun-adamw.md"),
    ("tiny-exact-norm-alpha", "fira@optim.alpha=0.1", "tiny-sweep-fira-alpha", 0.05, "rerun-fira-alpha0.1.md"),
    ("tiny-exact-norm-alpha", "adamw-grouped@optim.alpha=0.025", "tiny-sweep-fira-alpha", 0.05,
     "rerun-adamw-grouped-alpha0.025.md"),
])
def test_the_committed_rerun_tables_are_what_sweep_rerun_writes(folder: str, spec: str, earlier: str, lr: float,
                                                                table: str, monkeypatch) -> None:
    """docs/results/tiny-exact-norm*/rerun-*.md: each seed's runs in both sweep folders and their
    paired difference, as benchmarks/sweep_rerun.py computes them from the committed sweep.json."""
    monkeypatch.chdir(ROOT)  # the tables name the folders as the command gave them
    compare = _benchmark("sweep_rerun").compare
    text = compare(Path("docs/results") / folder, Path("docs/results") / earlier, spec, lr)
    assert text == (ROOT / "docs" / "results" / folder / table).read_text()
    with pytest.raises(SystemExit, match="holds no run of 'fira' at lr 0.5"):
        compare(Path("docs/results/tiny-exact-norm"), Path("docs/results/tiny-sweep-galore-raw"), "fira", 0.5)
    # its README: Fira's runs there equal int8-root-seeds' plain Fira runs (same code, another sitting)
    seeds = _benchmark("sweep_rerun").seed_values
    assert (seeds(Path("docs/results/tiny-exact-norm"), "fira", 0.02)
            == seeds(Path("docs/results/int8-root-seeds"), "fira", 0.02))


def test_sweep_rerun_reads_sweeps_without_a_test_split_and_names_why_an_interval_is_missing(tmp_path: Path) -> None:
    def sweep(folder: Path, vals: list[float]) -> Path:
        folder.mkdir()
        runs = [{"spec": "fira", "lr": 0.02, "seed": s, "val_ppl": None if v == math.inf else v, "test_ppl": None,
                 "diverged": v == math.inf} for s, v in enumerate(vals)]
        (folder / "sweep.json").write_text(json.dumps({"runs": runs}))
        return folder

    text = _benchmark("sweep_rerun").compare(sweep(tmp_path / "new", [100.0, math.inf, 102.0]),
                                             sweep(tmp_path / "old", [101.0, 99.0, 103.0]), "fira", 0.02)
    assert "| val | +inf (a run diverged: no interval) | 0, 1, 2 |" in text
    assert "| test | no test split | - |" in text


def _benchmark(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _finetune_benchmark():
    return _benchmark("finetune_commonsense")


def test_finetune_benchmark_plans_sweeps_and_the_released_recipe() -> None:
    bench = _finetune_benchmark()
    parser = bench.argparse.ArgumentParser()
    lr_for = bench.parse_lrs(["lora=3e-4,1e-3", "fira=1e-4", "lora=3e-4"], parser)
    assert lr_for == {"lora": [3e-4, 1e-3], "fira": [1e-4]}
    runs = bench.plan_runs(["none", "lora", "fira", "released"], lr_for)
    assert [(r.name, r.method, r.recipe, r.lr) for r in runs] == [
        ("none", "none", None, None), ("lora-lr0.0003", "lora", None, 3e-4), ("lora-lr0.001", "lora", None, 1e-3),
        ("fira", "fira", None, 1e-4), ("released", "fira-lora", "released", None)]
    with pytest.raises(SystemExit, match="released recipe fixes its lr"):
        bench.plan_runs(["released"], {"released": [1e-4]})
    with pytest.raises(SystemExit):
        bench.parse_lrs(["fira=-1"], parser)


def test_finetune_benchmark_report_says_which_sitting_its_times_measure() -> None:
    bench = _finetune_benchmark()

    def result(resumed):
        return {"memory": {"train_peak_rss_mib": 1633.2}, "time": {"train_s": 1.8},
                "training": {"resumed_from_step": resumed}, "config": {"steps": 500}}

    assert bench.training_cells(result(None)) == ("1633", "2")
    assert bench.training_cells(result(100)) == ("1633", "2 (steps 101-500 only)")
    # resumed at its last step: the sitting only loaded and evaluated, no training time or peak
    assert bench.training_cells(result(500)) == ("-", "- (resumed at step 500: evaluated only)")
    # every sitting recorded: the whole training's time and its highest peak
    recorded = result(500)
    recorded["training"]["sittings"] = [{"from_step": 0, "to_step": 500, "seconds": 3000.0, "peak_rss_mib": 1700.0},
                                        {"from_step": 500, "to_step": 500, "seconds": 1.8, "peak_rss_mib": 900.0}]
    assert bench.training_cells(recorded) == ("1700", "3002 (2 sittings)")


def test_finetune_benchmark_reuses_only_runs_with_the_same_settings(tmp_path: Path) -> None:
    bench = _finetune_benchmark()
    args = bench.argparse.Namespace(scoring="loglik", max_eval=500, seed=42, steps=30, batch_size=4,
                                    max_new_tokens=16)
    run = bench.Run("fira", "fira", "fira", None, None, "Fira")
    config = {"tasks": bench.TASKS, "scoring": "loglik", "max_eval": 500, "seed": 42, "requested_method": "fira",
              "recipe": None, "steps": 30, "batch_size": 4, "lr": 5e-5}
    bench.check_reusable(run, {"config": config}, args, tmp_path / "results.json")  # same settings: fine
    with pytest.raises(SystemExit, match=r"max_eval=12 \(this command: 500\)"):
        bench.check_reusable(run, {"config": config | {"max_eval": 12}}, args, tmp_path / "results.json")
    # A run made at another lr is refused even when this command asks for the method's default.
    with pytest.raises(SystemExit, match=r"lr=0.0001 \(this command: 5e-05\)"):
        bench.check_reusable(run, {"config": config | {"lr": 1e-4}}, args, tmp_path / "results.json")
    old = {k: v for k, v in config.items() if k not in ("scoring", "recipe")}  # a run made before --scoring
    with pytest.raises(SystemExit, match=r"scoring='generate-released' \(this command: 'loglik'\)"):
        bench.check_reusable(run, {"config": old}, args, tmp_path / "results.json")


def test_finetune_benchmark_chooses_a_sweeps_lr_on_validation_only() -> None:
    """Swept runs score validation records (and are reused only with the same number); the
    report's choice is the highest validation accuracy, whatever the test accuracy."""
    bench = _finetune_benchmark()
    runs = bench.plan_runs(["released", "fira"], {"fira": [5e-5, 1e-4]})
    released, low, high = runs
    assert not released.swept and low.swept and high.swept
    args = bench.argparse.Namespace(scoring="loglik", max_eval=500, seed=42, steps=30, batch_size=4,
                                    max_new_tokens=16, max_val=150)
    assert bench.expected_config(low, args)["max_val"] == 150 and "max_val" not in bench.expected_config(released, args)

    def result(val, test):
        return {"average_accuracy": test, **({"validation_accuracy": val} if val is not None else {})}

    results = {"released": result(None, 0.5), low.name: result(0.40, 0.60), high.name: result(0.45, 0.50)}
    assert bench.choose_lrs(results, runs) == [
        "- Fira: **lr 0.0001**, at the grid's edge (validation 40.0% at lr 5e-05, 45.0% at lr 0.0001)"]
    tie = results | {high.name: result(0.40, 0.70)}  # equal validation: the smaller lr, in either order
    assert bench.choose_lrs(tie, runs)[0].startswith("- Fira: **lr 5e-05**, at the grid's edge")
    assert bench.chosen_runs(tie, [runs[0], high, low]) == {"fira": low}
    inside = bench.plan_runs(["fira"], {"fira": [5e-5, 1e-4, 2e-4]})
    scores = {r.name: result(v, 0.5) for r, v in zip(inside, (0.40, 0.45, 0.41))}
    assert bench.choose_lrs(scores, inside)[0].startswith("- Fira: **lr 0.0001** (validation")
    pending = bench.choose_lrs({low.name: results[low.name]}, runs)
    assert pending == ["- Fira: not chosen yet (lr 5e-05 validation 40.0%, lr 0.0001 validation -)"]
    assert bench.chosen_runs(results, runs) == {"fira": high}  # the released recipe is not a sweep
    assert bench.chosen_runs({low.name: results[low.name]}, runs) == {"fira": None}


def test_finetune_benchmark_records_every_sitting_that_trains(tmp_path: Path) -> None:
    """The report names each command that trained runs, not only the first one."""
    bench = _finetune_benchmark()
    first = {"date": "d1", "machine": "m", "command": "python b.py --methods fira"}
    second = {"date": "d2", "machine": "m", "command": "python b.py --methods adamw"}
    header_file = tmp_path / "methods" / "benchmark.json"
    fresh = bench.update_header(header_file, lambda old: bench.next_header(old, first))
    assert bench.sittings(fresh) == [first] and fresh["command"] == first["command"]
    # a second sitting, whether or not a run has finished yet (it may continue one's checkpoints)
    resumed = bench.update_header(header_file, lambda old: bench.next_header(old, second))
    assert bench.sittings(resumed) == [first, second] and json.loads(header_file.read_text()) == resumed
    # a state measurement merges into what is there, sittings included
    measured = bench.update_header(header_file, lambda old: {**old, "states": {"fira": {}}})
    assert bench.sittings(measured) == [first, second] and measured["states"] == {"fira": {}}
    # a header from before sittings were recorded: its top-level command is the first sitting
    legacy = {**first, "states": {"fira": {}}}
    assert bench.sittings(bench.next_header(legacy, second)) == [first, second]


def test_finetune_benchmark_report_only_needs_no_data(tmp_path: Path, monkeypatch) -> None:
    """--report-only reads the runs' records, not the commonsense files: it works without them
    (a training command still refuses a missing --data-dir)."""
    bench = _finetune_benchmark()
    out, absent = tmp_path / "runs", tmp_path / "absent"
    out.mkdir()
    monkeypatch.setattr(bench.signal, "signal", lambda *args: None)  # main's SIGTERM handler: not pytest's
    argv = ["finetune_commonsense.py", "--methods", "fira", "--data-dir", str(absent), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--report-only"])
    bench.main()
    assert "Fira" in (tmp_path / "report.md").read_text()
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        bench.main()


@needs_proc
def test_finetune_benchmark_stopped_by_sigterm_stops_its_run(tmp_path: Path, monkeypatch) -> None:
    """A benchmark sent SIGTERM alone (not its process group) must not leave its current run
    training: main() turns the signal into an exception, and subprocess.run kills the run."""
    import signal

    bench = _finetune_benchmark()
    installed = []
    monkeypatch.setattr(bench.signal, "signal", lambda signum, handler: installed.append((signum, handler)))
    monkeypatch.setattr(sys, "argv", ["finetune_commonsense.py", "--max-val", "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert installed == [(signal.SIGTERM, bench._stop)]

    marker = _stand_in_run(tmp_path)
    code = ("import signal, subprocess, sys\nsys.path.insert(0, 'benchmarks')\nimport finetune_commonsense as b\n"
            f"signal.signal(signal.SIGTERM, b._stop)\nsubprocess.run([sys.executable, {str(tmp_path / 'run.py')!r}])\n")
    with parent_and_pid([sys.executable, "-c", code], marker, cwd=ROOT) as (parent, run):
        # the run has started, so subprocess.run is waiting for it
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 128 + signal.SIGTERM
        assert ended(run)


@needs_proc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_finetune_benchmark_run_dies_with_a_killed_benchmark(tmp_path: Path) -> None:
    """SIGKILL of the benchmark (no handler runs) still ends its run: the kernel's parent-death signal."""
    marker = _stand_in_run(tmp_path)
    code = ("import subprocess, sys\nsys.path.insert(0, 'benchmarks')\nimport finetune_commonsense as b\n"
            f"subprocess.run([sys.executable, {str(tmp_path / 'run.py')!r}], preexec_fn=b._die_with_parent)\n")
    with parent_and_pid([sys.executable, "-c", code], marker, cwd=ROOT) as (parent, run):
        parent.kill()
        parent.wait()
        assert wait_for(lambda: ended(run), timeout_s=10), f"run {run} outlived the killed benchmark"


def _stand_in_run(folder: Path) -> Path:
    """``folder/run.py``: a stand-in for a fine-tuning run that writes its pid to the returned
    path and sleeps."""
    marker = folder / "run.pid"
    (folder / "run.py").write_text(f"import os, pathlib, time\npathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
                                   "time.sleep(120)\n")
    return marker


def test_allocator_benchmark_alternates_the_setting_and_pairs_the_processes(monkeypatch) -> None:
    bench = _benchmark("allocator_speed")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999")  # the caller's own value must not leak into "without"
    seen = []
    speeds = iter([100.0, 90.0, 80.0, 100.0, 50.0, 45.0])  # pair 0: A B; pair 1: B A; pair 2: A B

    def time_one(env, label):
        seen.append((label, env.get("MALLOC_MMAP_THRESHOLD_")))
        return {"fira": next(speeds)}

    runs = bench.alternate(3, "MALLOC_MMAP_THRESHOLD_", "131072", time_one)
    assert seen == [("pair 0, without", None), ("pair 0, with", "131072"), ("pair 1, with", "131072"),
                    ("pair 1, without", None), ("pair 2, without", None), ("pair 2, with", "131072")]
    summary = bench.summarize(runs, 3)["fira"]
    assert summary["ratios"] == pytest.approx([0.9, 0.8, 0.9])
    assert summary["ratio_mean"] == pytest.approx(2.6 / 3) and summary["ratio_median"] == pytest.approx(0.9)
    half = 4.302652729911275 * 0.1 / 3 ** 0.5 / 3 ** 0.5  # t_{0.975, 2} * sd / sqrt(n), sd = 0.1 / sqrt(3)
    assert (summary["ratio_low"], summary["ratio_high"]) == pytest.approx((2.6 / 3 - half, 2.6 / 3 + half))
    with pytest.raises(SystemExit):
        bench.parse_env("MALLOC_MMAP_THRESHOLD_", bench.argparse.ArgumentParser())


def test_gpu_memory_merge_takes_the_lanes_rows_into_the_committed_table(tmp_path: Path) -> None:
    """What a lent GPU brought back (a committed table with a lane's row and command appended)
    becomes the committed table: the command's --out is the committed folder, a comment line
    names the GPU, code and time, the new row carries its code, the old rows stay as they were."""
    committed = json.loads((ROOT / "docs/results/memory-measured/gpu-bf16/1b/memory.json").read_text())
    to, fetched = tmp_path / "to", tmp_path / "fetched"
    (to / "1b").mkdir(parents=True)
    (to / "1b" / "memory.json").write_text(json.dumps(committed))
    lane = ("fira-train memory --measure --recipe 1b --methods adamw@optim.lr=0.01 --steps 3 --append "
            "--out /root/out/1b")
    new_row = {**committed["rows"][0], "method": "adamw@optim.lr=0.01", "date": "2030-01-02"}
    del new_row["code"]
    back = {**committed, "command": committed["command"] + "\n" + lane, "rows": committed["rows"] + [new_row],
            "complete": False}
    (fetched / "1b").mkdir(parents=True)
    (fetched / "1b" / "memory.json").write_text(json.dumps(back))
    (fetched / "1b.log").write_text("lane log\n")
    (fetched / "cuda-tests.log").write_text("NVIDIA H200, 143771 MiB\n12 passed\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_memory_merge.py"), str(fetched),
                           "--code", "abc1234", "--when", "2030-01-02, 10:00-10:05 UTC", "--to", str(to)],
                          cwd=ROOT, timeout=120, capture_output=True, text=True, check=True)
    assert "1b: 1 new or re-measured rows: adamw@optim.lr=0.01" in done.stdout
    merged = json.loads((to / "1b" / "memory.json").read_text())
    assert merged["rows"][:-1] == committed["rows"]
    assert merged["rows"][-1]["code"] == "abc1234 (2030-01-02, 10:00-10:05 UTC)"
    lines = merged["command"].split("\n")
    assert lines[:-2] == committed["command"].split("\n")
    assert lines[-2] == ("# parallel lanes on one NVIDIA H200, each its own process, code abc1234 "
                         "(2030-01-02, 10:00-10:05 UTC), benchmarks/gpu_memory_rows.sh:")
    assert lines[-1] == lane.replace("/root/out/1b", str(to / "1b"))
    assert merged["complete"] is True and "missing" not in merged  # every named method has a row
    assert "incomplete" not in (to / "1b" / "memory.md").read_text()
    assert (to / "logs" / "lanes-1b.log").read_text() == "lane log\n"
    assert (to / "logs" / "lanes-cuda-tests.log").exists()


def test_the_finetune_memory_table_is_what_its_runs_recorded() -> None:
    """docs/results/finetune-memory/README.md: each row's peak, state and time from its results.json."""
    folder = ROOT / "docs" / "results" / "finetune-memory"
    rows = [line.split("|")[1:-1] for line in (folder / "README.md").read_text().splitlines()
            if re.match(r"\| [18] \| fira", line)]
    assert len(rows) == 6
    for batch, run, peak, state, seconds in ([c.strip() for c in row] for row in rows):
        results = json.loads((folder / f"batch{batch}" / run / "results.json").read_text())
        assert results["config"]["batch_size"] == int(batch)
        assert results["config"]["step_in_backward"] == ("in-backward" in run)
        assert results["config"]["state_dtype"] == ("int8" if run.endswith("int8") else "float32")
        assert peak == f"{results['memory']['train_peak_rss_mib']:.0f}"
        assert state == f"{results['memory']['optimizer_state_mib']:.1f}"
        assert seconds == f"{results['training']['seconds']:.1f}"
    # the drops the text gives, from the runs' own peaks (not from the table's rounded ones)
    peak = {(batch, run): json.loads((folder / f"batch{batch}" / run / "results.json").read_text())
            ["memory"]["train_peak_rss_mib"] for batch in (1, 8)
            for run in ("fira", "fira-in-backward", "fira-in-backward-int8")}
    text = " ".join((folder / "README.md").read_text().split())
    in_backward = [peak[b, "fira"] - peak[b, "fira-in-backward"] for b in (1, 8)]
    int8 = [peak[b, "fira-in-backward"] - peak[b, "fira-in-backward-int8"] for b in (8, 1)]
    assert f"at one sequence per batch the peak drops by {in_backward[0]:.0f} MiB" in text
    assert f"At 8 sequences it drops by {in_backward[1]:.0f} MiB only" in text
    assert f"The peak at 8 sequences drops by another {int8[0]:.0f} MiB; at one sequence by {int8[1]:.0f} MiB" in text
    # the batch-1 repetitions: each peak and the int8 saving from the runs' results.json
    reruns = [[c.strip() for c in line.split("|")[1:-1]] for line in (folder / "README.md").read_text().splitlines()
              if re.match(r"\| [12] \| (default|mmap128k) \|", line)]
    assert len(reruns) == 4
    for repetition, allocator, *peaks, saving in reruns:
        runs = [json.loads((folder / "batch1-rerun" / f"rep{repetition}-{allocator}" / run / "results.json").read_text())
                for run in ("fira", "fira-in-backward", "fira-in-backward-int8")]
        assert all(r["config"]["batch_size"] == 1 for r in runs)
        mib = [r["memory"]["train_peak_rss_mib"] for r in runs]
        assert peaks == [f"{m:.0f}" for m in mib] and saving == f"{mib[1] - mib[2]:.0f}"
        if repetition == "2":  # recorded since then
            assert all(r["memory"]["malloc_env"] == ({"MALLOC_MMAP_THRESHOLD_": "131072"} if allocator == "mmap128k"
                                                      else {}) for r in runs)


def test_the_relora_rewarmup_table_is_what_its_runs_recorded() -> None:
    """docs/results/relora-rewarmup/README.md: each seed's perplexities from the runs' summary.json,
    each run's recorded re-warm-up, and the paired test difference from sweep.json."""
    folder = ROOT / "docs" / "results" / "relora-rewarmup"
    text = (folder / "README.md").read_text()
    for spec, label, rewarmup in (("relora", "10 steps (today's default)", 10),
                                  ("relora@optim.relora_rewarmup=1", "1 step (the former default on `tiny`)", 1)):
        runs = [json.loads((folder / spec / "lr=0.001" / f"seed={seed}" / "summary.json").read_text()) for seed in (0, 1)]
        configs = [json.loads((folder / spec / "lr=0.001" / f"seed={seed}" / "config.json").read_text()) for seed in (0, 1)]
        assert all(c["optim"]["relora_rewarmup"] == rewarmup and c["optim"]["relora_every"] == 75 for c in configs)
        tests = [r["test_ppl"] for r in runs]
        mean, sd = sum(tests) / 2, abs(tests[0] - tests[1]) / math.sqrt(2)
        row = (f"| {label} | {runs[0]['val_ppl']:.2f} / {tests[0]:.2f} | {runs[1]['val_ppl']:.2f} / {tests[1]:.2f} "
               f"| {mean:.2f} ± {sd:.2f} |")
        assert row in text, row
    saved = json.loads((folder / "sweep.json").read_text())
    diff = next(m for m in saved["methods"] if m["spec"] != "relora")["test_ppl_minus_reference"]
    low, high = diff["ci95"]
    assert f"higher by {diff['mean']:.2f} (paired, 95%\n  interval [{low:+.2f}, {high:+.2f}])" in text


def test_the_peers_readme_counts_apollos_cached_projection_as_held() -> None:
    """docs/results/peers/README.md: APOLLO holds 10.43M elements on tiny, as Fira (its report,
    made before the projector object's matrix was counted, says 9.97M)."""
    import torch

    from fira_optim import optimizer_state_numel
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import tiny
    from fira_train.methods.model import build_model
    from fira_train.methods.registry import build_method

    held = {}
    for method in ("apollo", "fira"):
        config = apply_overrides(tiny(), [f"optim.method={method}"])
        setup = build_method(build_model(config.model, config.data.vocab_size, config.data.seq_len, seed=0), config)
        ids = torch.randint(0, config.data.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        setup.model(input_ids=ids, labels=ids).loss.backward()
        setup.optimizer.step()
        held[method] = optimizer_state_numel(setup.optimizer)
    assert held["apollo"] == held["fira"]
    assert f"APOLLO held\n  {held['apollo'] / 1e6:.2f}M elements on `tiny`, as many as Fira, not 9.97M" in (
        ROOT / "docs" / "results" / "peers" / "README.md").read_text()
    assert "| apollo | 64 | 6 | 0.01 | 5.0370 | 154.01 | 2,456 | 69.9% | 9.97M (38.0 MiB)" in (
        ROOT / "docs" / "results" / "peers" / "report.md").read_text()


def test_the_flora_default_lr_advice_quotes_its_committed_sweep() -> None:
    """The registry's Flora numbers are the committed sweep's (they were quoted from runs nothing kept)."""
    sweep = json.loads((ROOT / "docs" / "results" / "flora-micro" / "sweep.json").read_text())
    doc = " ".join((ROOT / "src" / "fira_train" / "methods" / "registry.py").read_text().split())
    flora = {float(lr): value for lr, value in _validation_by_lr(sweep, "flora").items()}
    quoted = " / ".join(f"{flora[lr]:.0f}" for lr in (0.001, 0.01, 0.03, 0.1, 0.3, 1.0))
    assert f"validation perplexity {quoted} (lr 3 diverged;" in doc
    walls = [json.loads(path.read_text())["wall_time_s"]
             for path in (ROOT / "docs" / "results" / "flora-micro").glob("*/lr=*/seed=0/summary.json")]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`wall_time_s` {min(walls):.1f}-{max(walls):.1f} s in its summaries" in readme
    assert f"AdamW {min(_validation_by_lr(sweep, 'adamw').values()):.0f} at its best lr" in doc


def _validation_by_lr(sweep: dict, spec: str) -> dict:
    (row,) = [row for row in sweep["methods"] if row["spec"] == spec]
    return {entry["lr"]: entry["val_ppl"]["mean"] for entry in row["val_ppl_by_lr"] if entry["val_ppl"]["mean"]}


@pytest.mark.timeout(300)
def test_bf16_state_rounding_script_runs_and_the_docs_quote_its_committed_numbers(tmp_path: Path) -> None:
    out = tmp_path / "rounding.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_state_rounding.py"), "--out", str(out)],
                   check=True, cwd=ROOT, timeout=280, capture_output=True)
    fresh = json.loads(out.read_text())
    committed = json.loads((ROOT / "docs" / "benchmarks" / "bf16_state_rounding.json").read_text())
    for result in (fresh, committed):
        assert result["tracking"].keys() == {f"{rounding}, {kind}" for rounding in ("nearest", "stochastic")
                                             for kind in ("projected", "plain")} | {"int8, plain"}
        assert len(result["median_step_seconds"]) == 4
    # Rounded to nearest, a step moves a bf16 v only if it changes it by more than half a bf16 step:
    # up by a gradient entry above about sqrt(3 v), never down (0.001 v is below half a step), so
    # v ratchets up and stays; with stochastic rounding it is the fp32 v on average.
    for kind in ("projected", "plain"):
        nearest, stochastic = (fresh["tracking"][f"{rounding}, {kind}"] for rounding in ("nearest", "stochastic"))
        assert nearest["mean_relative_error"] > 0.3, kind  # measured 0.46
        assert nearest["largest_relative_error"] > 1.0, kind  # after the drop: measured 1.57
        assert stochastic["mean_relative_error"] < 0.08, kind  # measured 0.035
        assert 0.98 < stochastic["ratio_of_means_min"] <= stochastic["ratio_of_means_max"] < 1.02, kind  # 0.3%
    # int8 codes (of sqrt(v), each block's scale re-derived at every step) drift far less than bf16
    # rounded to nearest: the reason they have no stochastic rounding
    int8 = fresh["tracking"]["int8, plain"]
    assert int8["mean_relative_error"] < 0.15 and int8["ratio_of_means_max"] < 1.15  # measured 0.083, 1.074
    track = committed["tracking"]
    docs = " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    assert (f"was {track['nearest, projected']['mean_relative_error']:.2f} rounded to nearest (the largest "
            f"{track['nearest, projected']['largest_relative_error']:.2f}") in docs
    assert (f"{track['stochastic, projected']['mean_relative_error']:.3f} and "
            f"{track['stochastic, plain']['mean_relative_error']:.3f} stochastically (the largest "
            f"{track['stochastic, projected']['largest_relative_error']:.3f} and "
            f"{track['stochastic, plain']['largest_relative_error']:.3f};") in docs
    int8 = track["int8, plain"]
    assert (f"far less than bf16 ones ({int8['mean_relative_error']:.3f}, the largest "
            f"{int8['largest_relative_error']:.3f}; mean `v` up to {int8['ratio_of_means_max']:.2f} times") in docs
    seconds = committed["median_step_seconds"]
    assert (f"took {1e3 * seconds['stochastic, plain 4096 x 256']:.0f} ms stochastically, "
            f"{1e3 * seconds['nearest, plain 4096 x 256']:.0f} ms to nearest") in docs
    for result in (fresh, committed):
        assert len(result["median_seconds_per_million_16_bit_numbers"]) == 2
    noise = committed["median_seconds_per_million_16_bit_numbers"]
    assert (f"the noise of 1M elements took {1e3 * noise['uniform_bits16 (four per 64-bit draw)']:.2f} ms, "
            f"against {1e3 * noise['torch.randint (one per draw)']:.2f} ms") in docs


def test_the_long_bf16_states_table_is_what_its_runs_recorded() -> None:
    """docs/results/bf16-states-long/README.md: each seed's test perplexity and the paired
    intervals, from the runs' summary.json (the intervals by the sweep's own statistics)."""
    from fira_train.sweep.stats import mean_interval

    folder = ROOT / "docs" / "results" / "bf16-states-long"
    runs = {"fp32 states (plain Fira)": "fira", "bf16 states, nearest": "fira@optim.state_dtype=bfloat16",
            "bf16 states, stochastic": "fira@optim.state_dtype=bfloat16@optim.state_rounding=stochastic"}
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                               for line in (folder / "README.md").read_text().splitlines())
            if cells and cells[0] in runs}
    assert rows.keys() == runs.keys()
    test = {}
    for label, spec in runs.items():
        lr, *seeds, _ = rows[label]
        test[label] = [json.loads((folder / spec / f"lr={lr}" / f"seed={s}" / "summary.json").read_text())["test_ppl"]
                       for s in range(5)]
        assert seeds == [f"{value:.2f}" for value in test[label]], label
    sweep = json.loads((folder / "sweep.json").read_text())
    assert {row["spec"]: row["chosen_lr"] for row in sweep["methods"]} == {
        spec: float(rows[label][0]) for label, spec in runs.items()}
    reference = test["fp32 states (plain Fira)"]
    for label in ("bf16 states, nearest", "bf16 states, stochastic"):
        mean, low, high = mean_interval([a - b for a, b in zip(test[label], reference)])
        assert rows[label][-1] == f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]", label
    # the cost of nearest rounding as the docs word it: a share of fp32's test perplexity per seed and on average
    nearest = test["bf16 states, nearest"]
    shares = [100 * (a / b - 1) for a, b in zip(nearest, reference)]
    average = 100 * (sum(nearest) / sum(reference) - 1)
    span = f"{min(shares):.1f}-{max(shares):.1f}% ({average:.1f}% on average"
    assert min(shares) > 0
    assert f"against fp32 states at every seed, {span})" in " ".join((folder / "README.md").read_text().split())
    assert f"at every seed, by {span};" in " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    assert f"nearest rounding cost {average:.1f}% of test perplexity against fp32 states" in " ".join(
        (ROOT / "README.md").read_text().split())


@pytest.mark.parametrize("folder", sorted(path.parent.name for path in (ROOT / "docs" / "results").glob("*/sweep.json")))
def test_each_committed_sweep_report_is_what_its_sweep_json_gives(folder: str, tmp_path: Path) -> None:
    """docs/results/*/report.md of a sweep is what `fira-train sweep --report-only` writes from the
    folder's sweep.json, and its summary rows are what the runs there give: the docs quote these
    reports, so a hand edit of either file, or a renderer that no longer writes them, fails here."""
    from fira_train.sweep.driver import rewrite_report

    committed = ROOT / "docs" / "results" / folder
    shutil.copy(committed / "sweep.json", tmp_path / "sweep.json")
    report, _ = rewrite_report(tmp_path)
    assert report.read_text() == (committed / "report.md").read_text()
    rebuilt = json.loads((tmp_path / "sweep.json").read_text())
    assert rebuilt["methods"] == json.loads((committed / "sweep.json").read_text())["methods"]


def _sweep_methods(folder: str) -> dict:
    sweep = json.loads((ROOT / "docs" / "results" / folder / "sweep.json").read_text())
    return {row["spec"]: row for row in sweep["methods"]}


def _mean_sd(row: dict, digits: int) -> str:
    return f"{row['test_ppl']['mean']:.{digits}f} ± {row['test_ppl']['sd']:.{digits}f}"


def _paired(row: dict, digits: int, *, negated: bool = False) -> str:
    """The row's test difference to its sweep's reference with the 95% interval; negated: the
    reference minus the row."""
    difference = row["test_ppl_minus_reference"]
    mean, (low, high) = difference["mean"], difference["ci95"]
    if negated:
        mean, low, high = -mean, -high, -low
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def test_the_readme_and_the_results_index_quote_the_committed_sweeps() -> None:
    """README.md's measured result and docs/results/README.md's index give each sweep's test
    perplexity (mean ± sd) and paired difference as its sweep.json records them, rounded as
    printed there: a sweep rerun into its folder without the docs, or a hand edit, fails here."""
    sweep, raw = _sweep_methods("tiny-sweep"), _sweep_methods("tiny-sweep-galore-raw")
    exact, grouped = _sweep_methods("tiny-exact-norm"), _sweep_methods("tiny-sweep-grouped-alpha")
    alpha, exact_alpha = _sweep_methods("tiny-sweep-fira-alpha"), _sweep_methods("tiny-exact-norm-alpha")
    fira_raw, adamw = sweep["fira@optim.align_signs=false"], sweep["adamw"]
    best_fira, best_grouped = alpha["fira@optim.alpha=0.1"], alpha["adamw-grouped@optim.alpha=0.025"]
    readme = [
        f"({_mean_sd(fira_raw, 1)} against {_mean_sd(adamw, 1)})",
        f"({_mean_sd(best_grouped, 1)} against {_mean_sd(best_fira, 1)}, difference {_paired(best_grouped, 1)})",
        f"Fira with raw signs (today's default) {_mean_sd(fira_raw, 1)}, with aligned signs (its default then) "
        f"{_mean_sd(sweep['fira'], 1)}; GaLore (aligned signs) {_mean_sd(sweep['galore'], 1)}, Fira (aligned) - GaLore "
        f"{_paired(sweep['galore'], 1, negated=True)}; AdamW {_mean_sd(adamw, 1)}, AdamW - Fira (aligned) "
        f"{_paired(adamw, 1)}.",
        f"{_mean_sd(raw['galore'], 1)} against Fira's {_mean_sd(raw['fira'], 1)} there, GaLore - Fira "
        f"{_paired(raw['galore'], 1)}.",
        f"{_mean_sd(exact['galore'], 1)} against {_mean_sd(exact['fira'], 1)}, {_paired(exact['galore'], 1)}, still not",
        f"({_mean_sd(exact['adamw'], 1)}, minus Fira {_paired(exact['adamw'], 1)})",
        f"at alpha 0.1 (H200), {_mean_sd(sweep['adamw-grouped@optim.alpha=0.1'], 1)}, still behind Fira (minus the "
        f"H200's aligned-sign Fira: {_paired(sweep['adamw-grouped@optim.alpha=0.1'], 1)})",
        f"at alpha 0.05 {_mean_sd(grouped['adamw-grouped@optim.alpha=0.05'], 1)}, minus Fira "
        f"{_paired(grouped['adamw-grouped@optim.alpha=0.05'], 1)};",
        f"{_mean_sd(grouped['adamw-grouped@optim.alpha=0.025'], 1)}, minus Fira "
        f"{_paired(grouped['adamw-grouped@optim.alpha=0.025'], 1)}, lower at every seed",
        f"Fira {_mean_sd(best_fira, 1)}, and this AdamW minus Fira {_paired(best_grouped, 1)}",
        f"Fira {_mean_sd(exact_alpha['fira@optim.alpha=0.1'], 1)}, AdamW minus Fira "
        f"{_paired(exact_alpha['adamw-grouped@optim.alpha=0.025'], 1)}; AdamW at half that alpha is behind, "
        f"{_paired(exact_alpha['adamw-grouped@optim.alpha=0.0125'], 1)}",
    ]
    bf16, bf16_long = _sweep_methods("bf16-states"), _sweep_methods("bf16-states-long")
    relora = _sweep_methods("relora-rewarmup")
    nearest, stochastic = "fira@optim.state_dtype=bfloat16", "fira@optim.state_dtype=bfloat16@optim.state_rounding=stochastic"
    index = [
        f"GaLore - Fira {_paired(raw['galore'], 2)} test perplexity",
        f"GaLore - Fira {_paired(exact['galore'], 2)} test perplexity, not separated; AdamW - Fira "
        f"{_paired(exact['adamw'], 2)};",
        f"`adamw-grouped` minus Fira {_paired(exact_alpha['adamw-grouped@optim.alpha=0.025'], 2)} test perplexity, not "
        f"separated; at alpha 0.0125 {_paired(exact_alpha['adamw-grouped@optim.alpha=0.0125'], 2)}",
        f"at 0.05 not separated ({_paired(grouped['adamw-grouped@optim.alpha=0.05'], 2)} test perplexity",
        f"({_paired(grouped['adamw-grouped@optim.alpha=0.025'], 2)} at lr 0.05",
        f"test perplexity {_mean_sd(best_fira, 2)}; the best `adamw-grouped` (alpha 0.025) is then not separated from "
        f"it, {_paired(best_grouped, 2)}",
        f"int8 minus fp32 states {_paired(_sweep_methods('int8-root-seeds')['fira@optim.state_dtype=int8'], 2)} test "
        f"perplexity",
        f"test perplexity {_paired(bf16[nearest], 2)} and {_paired(bf16[stochastic], 2)} from fp32 states",
        f"nearest rounding {_paired(bf16_long[nearest], 2)} test perplexity from fp32 states",
        f"stochastic {_paired(bf16_long[stochastic], 2)}, not separated",
        f"test perplexity {_mean_sd(relora['relora'], 2)} against {_mean_sd(relora['relora@optim.relora_rewarmup=1'], 2)}, "
        f"the 1-step ramp higher by {_paired(relora['relora@optim.relora_rewarmup=1'], 2)}",
    ]
    for path, quotes in ((ROOT / "README.md", readme), (ROOT / "docs" / "results" / "README.md", index)):
        text = " ".join(path.read_text().replace("**", "").split())
        missing = [quote for quote in quotes if quote not in text]
        assert not missing, f"{path.relative_to(ROOT)} no longer quotes: {missing}"


@pytest.mark.timeout(240)
def test_matrix_step_memory_script_runs_and_the_docs_quote_its_committed_numbers(tmp_path: Path) -> None:
    """benchmarks/matrix_step_memory.py: a matrix's step through the fast path holds less than
    through the reference path, and that one two fp32 m x n terms, not one per term (a small
    matrix here, each arm in its own process); the docs quote the committed runs."""
    out = tmp_path / "matrix.json"
    # Freed memory returned to the system (a fixed mmap threshold): under glibc's default, which
    # keeps a freed block's pages and moves its threshold, this small matrix's figures swung by
    # about 4 bytes per element from run to run (the fast bf16 path measured 10.8-16.8 and the
    # reference 16.6-20.7, so that one CI run ordered them the wrong way round)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "matrix_step_memory.py"), "--rows", "512",
                    "--cols", "1024", "--rank", "32", "--repeats", "1", "--out", str(out),
                    "--arms", "fp32", "fp32 reference", "bf16", "bf16 reference"],
                   check=True, cwd=ROOT, timeout=220, capture_output=True,
                   env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    fresh = {arm: values[0] for arm, values in json.loads(out.read_text())["transient_bytes_per_element"].items()}
    assert list(fresh) == ["fp32", "fp32 reference", "bf16", "bf16 reference"]
    assert fresh["bf16"] < fresh["bf16 reference"]  # measured 8.6-8.9 against 16.2-16.5
    # measured 0.9-2.2 against 8.4-8.6; one tensor per term (the reference before) made it about 21 under
    # glibc's default
    assert fresh["fp32"] < fresh["fp32 reference"] <= 14
    committed = json.loads((ROOT / "docs" / "benchmarks" / "matrix_step_memory.json").read_text())
    assert committed["matrix"] == [2048, 5461] and committed["rank"] == 512
    per_element, seconds = committed["transient_bytes_per_element"], committed["median_step_seconds"]

    def span(values, fmt="{:.1f}"):
        low, high = fmt.format(min(values)), fmt.format(max(values))
        return low if low == high else f"{low}-{high}"

    def ms(values):
        return span([1e3 * v for v in values], "{:.0f}")

    optimizer = " ".join((ROOT / "docs" / "optimizer.md").read_text().split())
    assert (f"transient memory was {span(per_element['bf16'])} bytes per element of the matrix "
            f"({span(per_element['bf16 stochastic'])} with stochastic rounding; "
            f"{span(per_element['bf16 stochastic, noise in one piece'])} with the noise of the whole matrix drawn "
            f"at once) against {span(per_element['bf16 reference'])} through the reference path") in optimizer
    assert f"its step took {ms(seconds['bf16'])} ms against {ms(seconds['bf16 reference'])} ms" in optimizer
    measured = " ".join((ROOT / "docs" / "results" / "memory-measured" / "README.md").read_text().split())
    assert f"fp32 matrices, {span(per_element['bf16 reference'])} bytes per element" in measured
    # the fast path's figure is the fast path's: the reference path still forms S and the update
    assert f"fast path, which updates an fp32 copy of the matrix in place and rounds it into the weights once: " \
        f"{span(per_element['bf16'])} bytes per element" in measured
    assert f"still forms those terms: {span(per_element['bf16 reference'])} in the same run" in measured
    # the reference path in place: a later run of the same matrix
    later = json.loads((ROOT / "docs" / "benchmarks" / "reference_step_memory.json").read_text())
    assert later["matrix"] == [2048, 5461] and later["rank"] == 512
    now = later["transient_bytes_per_element"]
    assert (f"{span(now['bf16 reference'])} bytes per element with bf16 weights, {span(now['fp32 reference'])} "
            f"with fp32 weights (FRUGAL's the same; GaLore's {span(now['fp32 galore reference'])}), against "
            f"{span(now['bf16'])} and {span(now['fp32'])} on the fast path") in measured
    assert span(now["fp32 frugal"]) == span(now["fp32 reference"])
    assert (f"the step's transient memory with bf16 weights was {span(now['bf16 reference'])} bytes per element, "
            f"where one tensor per term took {span(per_element['bf16 reference'])} in the earlier run; with fp32 "
            f"weights {span(now['fp32 reference'])}") in optimizer


def test_a_recorded_command_quotes_arguments_with_spaces(monkeypatch) -> None:
    """matrix_step_memory.py's arms have spaces in their names: the command a JSON recorded ran
    as written only once they are quoted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import record
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmarks/matrix_step_memory.py", "--arms", "fp32", "bf16 reference"])
    assert record.provenance()["command"] == "python benchmarks/matrix_step_memory.py --arms fp32 'bf16 reference'"
    committed = json.loads((ROOT / "docs" / "benchmarks" / "reference_step_memory.json").read_text())
    assert "'fp32 galore reference'" in committed["command"]
