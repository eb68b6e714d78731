"""What users do, and what their machine does to a run: one line on stderr, exit status 1, no
traceback, and nothing lost (fira_train.user_errors; the divergence rule is run/test_divergence.py, the
JSON files test_files.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fira_train.cli import main
from fira_train.run import train as train_module
from fira_train.run.metrics import MetricsLog, read_metrics
from tests.fira_train.data.data_fixtures import read_only
from tests.fira_train.harness_fixtures import write_corpus


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro corpus and its tokenizer cache, shared by this module's runs."""
    root = tmp_path_factory.mktemp("user-errors")
    write_corpus(root / "corpus")
    return root


def _overrides(root: Path, cache: bool = True) -> list[str]:
    return [*([f"data.cache_dir={root / 'cache'}"] if cache else []), "data.vocab_size=300", "data.val_fraction=0.1",
            "train.progress=false", "train.tensorboard=false", "train.num_threads=1"]


def _pretrain(root: Path, out: Path, *extra: str, method: str = "adamw", steps: int = 4, cache: bool = True) -> int:
    """``extra`` flags, then overrides (trailing: so that the command also parses before overrides could
    stand anywhere, and a test fails on old code for its own reason)."""
    return main(["pretrain", "--recipe", "micro", "--method", method, "--steps", str(steps), "--out", str(out),
                 "--data", str(root / "corpus"), *extra, *_overrides(root, cache)])


def _error_line(capsys: pytest.CaptureFixture) -> str:
    """The one error line on stderr (log lines may surround it), after checking there is no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fira-train ")]
    assert len(lines) == 1 and lines[0].startswith("fira-train pretrain: error: "), err
    return lines[0]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))


def test_a_full_disk_is_one_line_and_the_checkpoints_stay(root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "run"
    log = MetricsLog.log

    def full_at_step_5(self, record):
        if record["step"] == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        log(self, record)

    monkeypatch.setattr(MetricsLog, "log", full_at_step_5)
    assert _pretrain(root, out, "--save-every", "2", steps=6) == 1
    line = _error_line(capsys)
    assert "no space left" in line and str(out) in line and "--resume" in line
    assert _checkpoints(out) == ["step_00000002", "step_00000004"]
    monkeypatch.setattr(MetricsLog, "log", log)  # space freed: the same command with --resume finishes
    assert _pretrain(root, out, "--save-every", "2", "--resume", steps=6) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("limit", ["full disk", "file size"])
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_earlier_ones_stay(root: Path, tmp_path: Path,
                                                                                   limit: str) -> None:
    """torch.save turns the OSError of a write into "RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos": a traceback, not one line. A real file-size limit (``ulimit -f``) in a child
    process gives EFBIG; a full disk is that error with ENOSPC (a tmpfs needs root to mount)."""
    out = tmp_path / "run"
    code = (
        "import errno, resource, sys, torch\n"
        "from fira_train.cli import main\n"
        "from fira_train.run import checkpoint\n"
        "save, saves = torch.save, []\n"
        "def full_on_the_second(obj, f, *a, **k):\n"
        "    saves.append(f)\n"
        "    if len(saves) > 1 and sys.argv[1] == 'full disk':\n"
        "        try:\n"
        "            raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "        except OSError:\n"
        "            raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 18496 vs 18390')\n"
        "    if len(saves) > 1:\n"
        "        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))\n"
        "    return save(obj, f, *a, **k)\n"
        "torch.save = full_on_the_second\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    args = ["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "4", "--out", str(out),
            "--data", str(root / "corpus"), "--save-every", "2", *_overrides(root)]
    done = subprocess.run([sys.executable, "-c", code, limit, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fira-train ")]
    assert len(lines) == 1, done.stderr
    expected = "no space left on the device" if limit == "full disk" else "grew past the largest this process may write"
    assert expected in lines[0] and "--resume" in lines[0] and "checkpoints already written" in lines[0]
    assert _checkpoints(out) == ["step_00000002"]


def test_a_data_build_that_fails_over_an_earlier_run_does_not_offer_resume_for_it(root: Path, tmp_path: Path,
                                                                                  monkeypatch, capsys) -> None:
    """--overwrite over a finished run, other settings: a full disk as the data was built said to
    run the same command again with --resume, which continues the earlier run (or says it is
    finished), not this one. The same command starts it again; with --resume it is this run."""
    from fira_train.data import build

    out, cache = tmp_path / "run", tmp_path / "cache"
    assert _pretrain(root, out, steps=2) == 0
    kept = (out / "summary.json").read_text()
    capsys.readouterr()

    def full(path, pieces, dtype):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(build, "save_pieces", full)
    argv = ["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "2", "--out", str(out),
            "--data", str(root / "corpus"), *_overrides(root, cache=False), f"data.cache_dir={cache}"]
    assert main([*argv, "--overwrite", "optim.lr=0.002"]) == 1
    line = _error_line(capsys)
    assert "no space left" in line and "--resume" not in line and "run the same command again (" in line
    assert f"before it wrote anything in {out}; what --overwrite replaces there is not deleted yet" in line
    assert (out / "summary.json").read_text() == kept
    assert main([*argv, "--resume"]) == 1  # this run, resumed: --resume goes on with it
    assert "again with --resume" in _error_line(capsys)


def test_a_read_only_out_is_one_line_naming_it(root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    read_only(monkeypatch, mounted)
    out = mounted / "run"
    assert _pretrain(root, out) == 1
    line = _error_line(capsys)
    assert str(out) in line and "Read-only file system" in line and "--out" in line


def test_a_cache_that_is_a_file_is_one_line_naming_fira_cache(root: Path, tmp_path: Path, monkeypatch,
                                                              capsys) -> None:
    cache = tmp_path / "cache-file"
    cache.write_text("not a folder")
    monkeypatch.setenv("FIRA_CACHE", str(cache))
    assert _pretrain(root, tmp_path / "run", cache=False) == 1
    line = _error_line(capsys)
    assert str(cache) in line and "$FIRA_CACHE" in line and "set FIRA_CACHE to a folder you can write" in line


def test_a_read_only_cache_is_one_line_naming_fira_cache(root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    read_only(monkeypatch, cache)
    monkeypatch.setenv("FIRA_CACHE", str(cache))
    assert _pretrain(root, tmp_path / "run", cache=False) == 1
    line = _error_line(capsys)
    assert str(cache) in line and "Read-only file system" in line and "FIRA_CACHE" in line


def test_a_missing_tokenizer_folder_names_it_and_the_real_override(root: Path, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "my-tokenizer"
    assert _pretrain(root, tmp_path / "run", f"data.tokenizer={missing}") == 1
    line = _error_line(capsys)
    assert str(missing) in line and "data.tokenizer=bpe" in line and "--tokenizer" not in line


def test_a_non_finite_gradient_says_the_run_diverged(root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    build = train_module.build_training

    def with_an_infinite_gradient(*args, **kwargs):
        training = build(*args, **kwargs)
        weight = next(p for p in training.model.parameters() if p.ndim == 2 and p.requires_grad)
        weight.register_hook(lambda grad: grad * float("inf"))
        return training

    monkeypatch.setattr(train_module, "build_training", with_an_infinite_gradient)
    out = tmp_path / "run"
    assert _pretrain(root, out, method="fira") == 1
    line = _error_line(capsys)
    assert "diverged" in line and "non-finite gradient" in line and "optim.lr" in line
    assert "nonfinite=" not in line  # the optimizer's API hint is no command-line option
    assert str(out) in line


def test_a_non_finite_gradient_raised_in_a_ddp_hook_is_the_same_one_line() -> None:
    """Under DDP with updates in the backward pass the error comes wrapped by torch's future."""
    import argparse

    from fira_train.user_errors import describe

    wrapped = RuntimeError("Got the following error when running the callback: NonFiniteGradientError: "
                           "non-finite gradient in model.layers.0.mlp.up_proj.weight; nothing was updated "
                           "(pass nonfinite='skip' to skip such steps)")
    line = describe(wrapped, argparse.Namespace(out="runs/x"))
    assert line.startswith("the run diverged: non-finite gradient in model.layers.0.mlp.up_proj.weight, nothing of "
                           "that step was saved;")
    # the matrices updated before it in the backward pass were updated: the line does not deny it
    kept = RuntimeError("Got the following error when running the callback: NonFiniteGradientError: "
                        "non-finite gradient in model.layers.0.mlp.up_proj.weight; this parameter was not updated, "
                        "but the 3 others updated in the backward pass since the last optimizer.step() keep their "
                        "update (step_in_backward updates each as its gradient is complete) (pass nonfinite='skip' "
                        "to skip such steps)")
    assert "nothing was updated" not in describe(kept, argparse.Namespace(out="runs/x"))
    # a resume must keep optim.lr and train.grad_clip: it offered --resume-step, which then refused
    # the changed settings (and only pretrain has that flag); --overwrite only where the command has it
    assert "train the run again" in line and "--resume-step" not in line and "--overwrite" not in line
    line = describe(wrapped, argparse.Namespace(out="runs/x", overwrite=False, command="compare"))
    assert "optim.lr or set train.grad_clip" in line
    # what stays is said before --overwrite, which does not keep it; compare's --overwrite starts
    # every method over (it said "starts it over", of the diverged run)
    assert line.endswith("(the checkpoints already written in runs/x stay); --overwrite starts the comparison "
                         "over, its finished methods too")
    line = describe(wrapped, argparse.Namespace(out="runs/x", overwrite=False, command="finetune"))
    assert "; lower --lr and train the run again" in line and "optim.lr" not in line
    assert describe(RuntimeError("some other failure"), argparse.Namespace()) is None  # a bug: its traceback


def test_a_rank_whose_peer_stopped_says_so_in_one_line() -> None:
    """Under torchrun, the other ranks of a rank that stopped (a full disk there, one line) failed in
    their next collective with torch's traceback, which buried that line; now they say that another
    process stopped and that its error says why. The gloo text is a 2-process DDP run's, NCCL's its
    documented one."""
    import argparse

    from fira_train.user_errors import describe

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:3509. This is typically caused by a remote worker crashing. "
                        "Check the logs of the remote worker before reporting an error. GLHF!")
    line = describe(gloo, argparse.Namespace(out="runs/x", command="pretrain"))
    assert line.startswith("another process of this torchrun launch stopped (Connection closed by peer)")
    assert "again with --resume (the checkpoints already written in runs/x stay)" in line and "\n" not in line
    # Ctrl-C under torchrun (SIGINT to each process in turn): the rank interrupted first printed
    # "interrupted", the next one this line, which sent the user looking for an error none made
    assert "stopped (Connection closed by peer): if it was interrupted (Ctrl-C), nothing needs fixing; else " in line
    # a peer killed (kill -9, the out-of-memory killer) printed no error: torchrun's report names its signal
    assert "(one killed, by kill -9 or the out-of-memory killer, printed none: torchrun's report names its signal)" in line
    # each command's own way on (compare --parallel ddp resumes too; analyze, which has no --resume, reuses)
    assert "again with --reuse" in describe(gloo, argparse.Namespace(out="runs/x", command="analyze"))
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error")
    assert "another process of this torchrun launch stopped" in describe(nccl, argparse.Namespace())
    # the same words from elsewhere (streaming C4) are not a peer's
    assert describe(RuntimeError("Connection reset by peer while reading allenai/c4"), argparse.Namespace()) is None


def test_a_collective_that_timed_out_names_train_dist_timeout_s() -> None:
    """A peer that hung (not dead) failed the others' collective after the process group's timeout
    with torch's traceback; the line says how long they waited and the setting that sets it. The
    gloo text is a 2-process DDP run's, NCCL's its watchdog's."""
    import argparse

    from fira_train.user_errors import describe

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 5000ms for recv operation to complete")
    line = describe(gloo, argparse.Namespace(out="runs/x", command="pretrain"))
    assert line.startswith("a collective of this torchrun launch waited 5 s (train.dist_timeout_s) for another "
                           "process that did not answer: it hung")
    assert "again with --resume (the checkpoints already written in runs/x stay)" in line and "\n" not in line
    nccl = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
                        "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
    assert "waited 600 s (train.dist_timeout_s)" in describe(nccl, argparse.Namespace())
    # a peer that hung (or started that much later) before joining the group: torchrun's store
    # waited for its address as long, and the traceback said neither how long nor the setting
    join = type("DistStoreError", (RuntimeError,), {})("wait timeout after 2000ms, keys: /default_pg/0//cpu//0/1")
    assert describe(join, argparse.Namespace(out="runs/x", command="pretrain")).startswith(
        "joining the process group of this torchrun launch waited 2 s (train.dist_timeout_s) for another process "
        "that did not answer: it hung")


def test_a_damaged_config_json_on_resume_names_the_file(root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert _pretrain(root, out, steps=2) == 0
    (out / "config.json").write_text('{"model": {"hidden_size": 6')
    assert _pretrain(root, out, "--resume", steps=2) == 1
    line = _error_line(capsys)
    assert str(out / "config.json") in line and "not valid JSON" in line and "restore it" in line
    assert _checkpoints(out)  # nothing deleted


def test_a_damaged_metrics_jsonl_on_resume_names_the_file_and_line(root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert _pretrain(root, out, "--save-every", "1", steps=2) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + "\n")
    (out / "summary.json").unlink()  # as a run stopped while writing: unfinished, so --resume goes on
    assert _pretrain(root, out, "--save-every", "1", "--resume", steps=2) == 1
    line = _error_line(capsys)
    assert str(out / "metrics.jsonl") in line and "line 2" in line and "damaged" in line


def test_a_diverging_run_exits_non_zero_and_writes_no_infinity(root: Path, tmp_path: Path, capsys) -> None:
    """AdamW at lr 10: the loss reaches the thousands at step 2 (validation perplexity would be inf)."""
    out = tmp_path / "run"
    assert _pretrain(root, out, "--lr", "10", "--save-every", "1", "train.warmup_fraction=0", steps=4) == 1
    line = _error_line(capsys)
    assert "the run diverged at step 2: training loss" in line and "optim.lr" in line
    assert "train the run again" in line and "; --overwrite starts it over" in line and "--resume-step" not in line
    assert not (out / "summary.json").exists()  # never mistaken for a finished run
    assert _checkpoints(out) == ["step_00000001"]  # the step before the divergence stays
    text = (out / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text


def test_a_diverged_validation_loss_is_logged_as_null_and_stops_the_run(root: Path, tmp_path: Path, monkeypatch,
                                                                        capsys) -> None:
    monkeypatch.setattr(train_module, "evaluate", lambda *args, **kwargs: (800.0, 1))  # exp(800) overflows
    out = tmp_path / "run"
    assert _pretrain(root, out, "--eval-every", "2", "--save-every", "1", steps=4) == 1
    line = _error_line(capsys)
    assert "diverged at step 2: validation loss 800" in line
    text = (out / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text
    records = read_metrics(out)
    assert records[-1]["step"] == 2 and records[-1]["val_loss"] == 800.0 and records[-1]["val_ppl"] is None
    assert _checkpoints(out) == ["step_00000001"]  # the diverged weights of step 2 are not kept
    assert not (out / "summary.json").exists()


def test_errors_that_are_bugs_keep_their_traceback(monkeypatch) -> None:
    """Only what users do becomes one line: an unexpected exception still raises."""
    from fira_train.user_errors import describe

    assert describe(KeyError("x")) is None and describe(TypeError("x")) is None
    assert describe(ValueError("bad value")) == "bad value"
    monkeypatch.setenv("FIRA_TRACEBACK", "1")
    assert describe(ValueError("bad value")) is None


def test_one_line_even_for_multi_line_messages() -> None:
    from fira_train.user_errors import describe

    assert describe(OSError("could not load\n  tokenizer 'x'")) == "could not load tokenizer 'x'"


class SafetensorError(Exception):
    """As safetensors raises it: a Rust I/O error named in the message, no OSError behind it."""


@pytest.mark.parametrize(("error", "start"), [
    (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "no space left on the device holding {out} (No space left on device): free some space (or point --out or "
     "FIRA_CACHE at another disk)"),
    (SafetensorError("Error while serializing: I/O error: File too large (os error 27)"),
     "a file in {out} grew past the largest this process may write (File too large; `ulimit -f`"),
    # torch.save given a path (the Trainer's optimizer.pt) writes from C++: it cannot tell why a write fell short
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 65846144 vs 65846036"),
     "a file in {out} could not be written whole (torch.save: [enforce fail at inline_container.cc:672] . "
     "unexpected pos 65846144 vs 65846036): the disk is full, a file-size limit"),
])
def test_a_full_disk_inside_a_library_writer_is_one_line(error: Exception, start: str, tmp_path: Path) -> None:
    """fira-train finetune on a full disk ended in 40 lines of traceback."""
    from argparse import Namespace

    from fira_train.user_errors import describe

    line = describe(error, Namespace(command="finetune", out=str(tmp_path)))
    assert line is not None and line.startswith(start.format(out=tmp_path)), line
    assert "run the same command again (the checkpoints already written" in line
    assert describe(SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")) is None


def test_a_full_disk_names_the_next_command_of_sweep_and_memory(tmp_path: Path) -> None:
    """The advice was "run the same command again", which sweep (without --reuse) and memory
    --measure (without --append) then refused; memory keeps rows, not checkpoints."""
    from argparse import Namespace

    from fira_train.user_errors import _memory_json, describe

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert "run the same command again with --reuse (nothing was kept in" in describe(  # no run yet
        full, Namespace(command="sweep", out=str(tmp_path)))
    (tmp_path / "fira" / "lr=0.01" / "seed=0" / "summary.json").parent.mkdir(parents=True)
    (tmp_path / "fira" / "lr=0.01" / "seed=0" / "summary.json").write_text("{}")
    assert "run the same command again with --reuse (the checkpoints already written" in describe(
        full, Namespace(command="sweep", out=str(tmp_path)))
    memory = Namespace(command="memory", out=str(tmp_path / "mem"), recipe="MICRO")
    assert describe(full, memory).endswith("and run the same command again")  # nothing measured yet
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "memory.json").write_text("{}")
    assert describe(full, memory).endswith(
        "run the same command again with --append, its --methods cut to those not measured yet "
        f"(the methods measured so far stay in {tmp_path / 'mem' / 'memory.json'})")
    # analyze variance keeps nothing to go on from (a simulation; its report comes at the end)
    variance = Namespace(command="analyze", analysis_name="variance", out=str(tmp_path))
    assert describe(full, variance).endswith("and run the same command again")
    # without --out: the folder of the recipe as it is looked up, in lower case
    assert _memory_json(Namespace(command="memory", out=None, recipe="MICRO")) == Path("runs/micro-memory/memory.json")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_memory_without_measure_into_a_full_stdout_is_one_line_not_a_crash_of_the_handler() -> None:
    """The full-disk message looked for memory --measure's folder, from a recipe memory without
    --measure does not have (AttributeError inside the error handler, 38 lines)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "fira_train", "memory"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.startswith("fira-train")]
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(lines) == 1 and "no space left" in lines[0]


def test_a_model_too_large_for_memory_is_one_line_naming_the_setting(root: Path, tmp_path: Path, capsys) -> None:
    """model.hidden_size=10000000 ended in torch's DefaultCPUAllocator traceback. (2**40: larger
    than any address space, so the allocation fails however the system overcommits.)"""
    assert _pretrain(root, tmp_path / "run", f"model.hidden_size={2**40}", steps=1) == 1
    line = _error_line(capsys)
    assert line.startswith("fira-train pretrain: error: out of memory: allocating "), line
    assert f"; lower model.hidden_size={2**40}, or run it where more memory is free" in line


def test_an_analysis_too_large_for_memory_is_one_line_naming_the_flag(tmp_path: Path, capsys) -> None:
    """analyze variance --samples 100000000000 ended in numpy's _ArrayMemoryError traceback."""
    samples = str(2**50 // 800)  # a (samples, 100) float64 array of 1 PiB: no address space holds it
    assert main(["analyze", "variance", "--samples", samples, "--steps", "5", "--out", str(tmp_path / "v")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fira-train analyze: error: out of memory: allocating 1.00 PiB for an array with shape (")
    assert "in fira_train.analysis.variance." in err and f"lower --samples {samples}, or run it where" in err


def test_out_of_memory_from_cuda_or_a_child_process_is_one_line() -> None:
    """torch.OutOfMemoryError, and the text of one that came back from a run in its own process."""
    from argparse import Namespace

    import torch

    from fira_train.user_errors import describe

    finetune = Namespace(command="finetune", argv=["--tasks", "boolq", "--batch-size", "64", "--cutoff-len=512"])
    line = describe(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                           "capacity of 23.6 GiB"), finetune)
    assert line == ("out of memory: allocating 20.00 GiB (OutOfMemoryError); lower --batch-size 64, --cutoff-len=512, "
                    "or run it where more memory is free")
    child = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")
    line = describe(child, Namespace(command="memory", argv=[], overrides=["train.micro_batch_size=64", "optim.lr=1"]))
    assert line == ("out of memory: allocating 2.00 GiB (RuntimeError); lower train.micro_batch_size=64, or run it "
                    "where more memory is free")
    assert describe(MemoryError(), Namespace(command="pretrain")).startswith(
        "out of memory: an allocation failed (MemoryError); lower what sizes it (the model: model.*")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_named_as_standard_output_not_the_run_folder() -> None:
    """It said "no space left on the device holding the output folder": the run folder was blamed,
    and a short output failed only at the interpreter's exit (a traceback after the command)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "fira_train", "methods"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stderr == (
        "fira-train methods: error: no space left on the device holding standard output (No space left on device): "
        "free some space (or send standard output to another disk) and run the same command again\n")


def test_a_command_with_standard_output_closed_runs_as_before(tmp_path: Path) -> None:
    """Closed (`>&-`, some launchers), sys.stdout is None: print writes nothing, and the wrapper
    that names standard output in a full-disk error crashed every command on its first write
    (and pretrain on its progress bar)."""
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m fira_train methods >&-", shell=True, stderr=subprocess.PIPE,
                          text=True, timeout=120, check=False, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr


def test_the_harness_own_errors_that_mention_memory_keep_their_message() -> None:
    """A checkpoint whose metadata failed to unpickle with a MemoryError, and a run killed by
    SIGKILL ("out of memory?"), were told as allocations that failed."""
    from fira_train.run.checkpoint import CheckpointError
    from fira_train.user_errors import describe

    import torch

    from fira_train.run.isolated import IsolatedRunDied

    damaged = "checkpoint metadata 'r/.metadata' is truncated or damaged (MemoryError: )"
    assert describe(CheckpointError(damaged)) == damaged
    killed = "the run's process (pid 7) ended without a result: killed by SIGKILL (out of memory?)"
    assert describe(IsolatedRunDied(killed)).startswith(killed + ":")  # its own words, not a traceback
    assert describe(RuntimeError("the run failed: MemoryError")).startswith("out of memory: an allocation failed")
    # torch's own RuntimeErrors still are: CUDA's AcceleratorError, OutOfMemoryError's subclasses
    cuda = describe(torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be reported later"))
    assert cuda.startswith("out of memory: an allocation failed (AcceleratorError)")
    assert describe(type("Sub", (torch.OutOfMemoryError,), {})("x")).startswith("out of memory")


def test_a_full_stdout_of_a_run_is_not_blamed_on_its_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from fira_train import cli

    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self) -> None:
            pass

    monkeypatch.setattr(cli, "_pretrain", lambda args: print("validation perplexity ..."))
    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["pretrain", "--recipe", "micro", "--method", "adamw", "--out", str(tmp_path / "run")]) == 1
    line = _error_line(capsys)
    assert "no space left on the device holding standard output" in line and "send standard output" in line
    assert str(tmp_path / "run") + " " not in line.split("(the checkpoints")[0]


def test_an_output_folder_that_cannot_be_made_says_so(tmp_path: Path, capsys) -> None:
    """--out /proc/x: the line was "/proc/x: No such file or directory", without saying that it
    was making the output folder, nor what to do."""
    from argparse import Namespace

    from fira_train.user_errors import describe

    args = Namespace(command="pretrain", out="/nowhere/run", overrides=[])
    for path in ("/nowhere", "/nowhere/run"):
        assert describe(FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path), args) == (
            f"cannot create {path} for the output folder /nowhere/run: No such file or directory; "
            "pass --out with a folder you can write")
    # a file missing inside it, or elsewhere, is read, not made
    for path in ("/nowhere/run/checkpoints/step_00000002/state.pt", "/elsewhere/x"):
        assert describe(FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path), args) == (
            f"{path}: No such file or directory")
    if Path("/proc/self").is_dir():  # where no folder can be made
        assert main(["pretrain", "--recipe", "micro", "--method", "adamw", "--out", "/proc/fira-x/run"]) == 1
        assert "cannot create /proc/fira-x for the output folder /proc/fira-x/run" in capsys.readouterr().err


def test_a_full_disk_names_the_file_written_and_what_moves_it() -> None:
    """Any file's ENOSPC advised pointing --out at another disk (a temporary file, another folder)."""
    import tempfile
    from argparse import Namespace

    from fira_train.user_errors import describe

    args = Namespace(command="pretrain", out="/nonexistent-out/run", overrides=["data.cache_dir=/nonexistent-cache"])

    def full(path: str) -> str:
        return describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path), args)

    assert full("/nonexistent-out/run/metrics.jsonl").startswith(
        "no space left on the device holding /nonexistent-out/run/metrics.jsonl (No space left on device): "
        "free some space (or point --out at another disk) and run the same command again with --resume")
    # the setting that chose the cache: data.cache_dir here, FIRA_CACHE where the command left it out
    assert "(or point data.cache_dir at another disk)" in full("/nonexistent-cache/tokens.npy")
    default = Namespace(command="pretrain", out="/nonexistent-out/run", overrides=[])
    from fira_train.data.disk_cache import default_cache_dir

    cache = str(default_cache_dir())
    assert "(or point FIRA_CACHE at another disk)" in describe(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(cache, "tokens.npy")), default)
    temporary = os.path.join(tempfile.gettempdir(), "tmpx.safetensors")
    assert f"holding {temporary} (No space left on device): free some space (or point TMPDIR" in full(temporary)
    assert full("/nonexistent-root/other/file").startswith(
        "no space left on the device holding /nonexistent-root/other/file (No space left on device): free some "
        "space and run the same command again")
    assert "(or point --out or data.cache_dir at another disk)" in describe(  # no file named: either
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), args)
    # without --out, from a current folder that holds the temporary one: still the temporary file,
    # and a run folder under the current one's runs/ (the recipes' out_dir) still --out
    old_cwd = os.getcwd()
    try:
        os.chdir(tempfile.gettempdir())
        no_out = Namespace(command="pretrain", overrides=[])
        assert "(or point TMPDIR at another disk)" in describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                                                                       temporary), no_out)
        run_file = os.path.join(tempfile.gettempdir(), "runs", "tiny", "metrics.jsonl")
        assert "(or point --out at another disk)" in describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                                                                      run_file), no_out)
    finally:
        os.chdir(old_cwd)


def test_a_non_finite_parameter_behind_a_non_finite_gradient_is_said_whole_in_the_one_line() -> None:
    """The optimizer's note that the parameter itself is not finite stays whole (the line ends the
    place at the message's first ';')."""
    import argparse

    import torch

    from fira_optim import FiraAdamW, NonFiniteGradientError
    from fira_train.user_errors import describe

    w = torch.nn.Parameter(torch.full((6, 8), float("nan")))
    w.grad = torch.full((6, 8), float("nan"))
    try:
        FiraAdamW([{"params": [w], "rank": 2}]).step()
    except NonFiniteGradientError as err:
        line = describe(err, argparse.Namespace(out="runs/x"))
    assert "(the parameter itself holds NaN or Inf, written by an earlier step or by code outside the optimizer: " \
           "eps=0 writes them on a gradient entry that is 0, as torch.optim.AdamW does), nothing of that step was saved" in line


@pytest.mark.parametrize("argv", [["analyze", "rank-sweep", "--recipe", "micro", "--ranks", "4"],
                                  ["analyze", "variance"]])
def test_an_out_that_is_a_file_is_named_as_out(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The error named the file alone ('FILE: File exists (a file is where a folder is needed)'),
    not the option that gave it."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    assert main([*argv, "--out", str(taken)]) == 1
    assert f"(a file is where a folder is needed for --out {taken})" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"


def test_an_out_dir_override_that_is_a_file_is_named_as_the_override(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """pretrain's train.out_dir=FILE (the setting --out gives) was named as --out's file is: the
    message said only that a file was in the way."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    assert main(["pretrain", "--recipe", "micro", "--method", "fira", f"train.out_dir={taken}"]) == 1
    assert f"(a file is where a folder is needed for train.out_dir {taken})" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"
