"""The run's JSON files: null, never Infinity / NaN, for non-finite values; a damaged file is
named (fira_train.files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fira_train.files import DamagedFileError, cut_back_json_lines, dumps, read_json, write_text_atomic
from fira_train.run.metrics import MetricsLog, read_metrics
from fira_train.run.run_files import foreign_files


def test_json_files_write_null_for_non_finite_values(tmp_path: Path) -> None:
    text = dumps({"a": float("inf"), "b": [float("nan"), 1.5], "c": (float("-inf"),)})
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": [None]}
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log({"step": 1, "loss": 2.0, "val_ppl": float("inf")})
    log.close()
    assert "Infinity" not in (tmp_path / "metrics.jsonl").read_text()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0, "val_ppl": None}]
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DamagedFileError, match=r"bad\.json is damaged \(not UTF-8"):
        read_json(tmp_path / "bad.json")


def test_an_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "summary.json"
    assert write_text_atomic(path, '{"a": 1}\n') == path
    assert path.read_text() == '{"a": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]

    def full(*args):  # the disk filled up between writing the new content and renaming it over the old
        raise OSError("No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, '{"a": 2}\n')
    assert path.read_text() == '{"a": 1}\n'  # the old file, whole
    assert not (tmp_path / "summary.json.tmp").exists()  # and no part-written one beside it
    # a kill there leaves the new content beside the old: a file the run wrote, so resuming into
    # this folder is not refused
    (tmp_path / "summary.json.tmp").write_text('{"a": 2}\n')
    assert foreign_files(tmp_path) == []
    monkeypatch.undo()
    write_text_atomic(path, '{"a": 3}\n')
    assert path.read_text() == '{"a": 3}\n' and not (tmp_path / "summary.json.tmp").exists()


def test_locked_makes_a_second_holder_wait_for_the_first(tmp_path) -> None:
    """Two holders of one lock file (each its own open, as two processes have) take turns."""
    import threading
    import time

    from fira_train import files

    if files.fcntl is None:
        pytest.skip("no fcntl on this platform: nothing is locked")
    order: list[str] = []
    entered = threading.Event()

    def second() -> None:
        entered.wait()
        with files.locked(tmp_path / ".lock"):
            order.append("second")

    worker = threading.Thread(target=second)
    worker.start()
    with files.locked(tmp_path / ".lock"):
        entered.set()
        time.sleep(0.3)  # the second holder is blocked meanwhile
        order.append("first")
    worker.join(timeout=10)
    assert order == ["first", "second"]


def test_cut_back_json_lines_keeps_steps_up_to_the_checkpoint_and_drops_a_cut_line(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "x": NaN}\n\n{"step": 2}\n{"step": 3}\n{"step": 4, "x"')
    cut_back_json_lines(log, 2)
    assert log.read_text() == '{"step": 1, "x": NaN}\n{"step": 2}\n'  # kept as written, not re-encoded
    log.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(DamagedFileError, match="line 2 is not valid JSON"):
        cut_back_json_lines(log, 3, hint="delete it")
    for step in ('"x"', "null", "true", "[1]"):
        log.write_text(f'{{"step": 1}}\n{{"step": {step}}}\n')
        with pytest.raises(DamagedFileError, match="line 2 is not a step's record"):
            cut_back_json_lines(log, 3)


# ---------------------------------------------------------------- a run folder from elsewhere


def test_symbolic_links_below_a_folder_are_refused_by_name(tmp_path: Path) -> None:
    from fira_train.files import refuse_links

    out = tmp_path / "out"
    (out / "tb").mkdir(parents=True)
    refuse_links(out)
    refuse_links(tmp_path / "missing")  # nothing there yet: nothing to refuse
    linked = tmp_path / "linked-out"
    linked.symlink_to(out)
    refuse_links(linked)  # the --out itself may be a link (the user's choice)
    (out / "tb" / "events").symlink_to(tmp_path / "victim")
    with pytest.raises(ValueError, match=r"holds links \('.*tb/events': symbolic, or files with other hard links\)"):
        refuse_links(out)
    for i in range(4):
        (out / f"link{i}").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="and 2 more"):
        refuse_links(out)


def test_an_atomic_write_replaces_a_link_planted_as_its_temp_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("SECRET")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json.tmp").symlink_to(victim)
    write_text_atomic(out / "summary.json", "{}\n")
    assert victim.read_text() == "SECRET"
    assert (out / "summary.json").read_text() == "{}\n" and not (out / "summary.json").is_symlink()


def test_the_lock_and_the_metrics_never_open_through_a_link(tmp_path: Path) -> None:
    from fira_train.run.run_lock import LOCK_FILE, locked_run_directory

    victim = tmp_path / "victim"
    victim.write_text("SECRET")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(victim)
    with pytest.raises(OSError):
        with locked_run_directory(out):
            pass
    (out / "metrics.jsonl").symlink_to(tmp_path / "created-outside")
    with pytest.raises(OSError):
        MetricsLog(out, tensorboard=False)
    assert victim.read_text() == "SECRET" and not (tmp_path / "created-outside").exists()


def test_every_command_refuses_an_out_holding_links_before_it_trains(tmp_path: Path) -> None:
    from fira_train.analysis.runs import AnalysisRun, train_runs
    from fira_train.compare import compare
    from fira_train.config.method_spec import parse_method_specs
    from fira_train.measure import measure
    from fira_train.sweep.driver import sweep
    from tests.fira_train.harness_fixtures import micro_config

    config = micro_config(tmp_path, "train.steps=1")
    out = tmp_path / "out"
    (out / "adamw").mkdir(parents=True)
    (out / "adamw" / "summary.json").symlink_to(tmp_path / "victim")
    calls = {
        "compare": lambda: compare(config, ["adamw"], out),
        "sweep": lambda: sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out),
        "measure": lambda: measure(config, parse_method_specs("adamw"), 1, out),
        "analyze": lambda: train_runs(config, [AnalysisRun("adamw", "adamw")], out, title="# T"),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="holds links"):
            call()
        assert not (tmp_path / "victim").exists() and not (out / "report.md").exists(), name


def test_hard_links_and_unlisted_folders_below_a_folder_are_refused(tmp_path: Path) -> None:
    """An archive can hold a hard link to a file beside the folder it is unpacked into, and a
    folder that cannot be listed: os.walk skipped it, with the links it holds."""
    from fira_train.files import refuse_links
    from fira_train.run.run_lock import LOCK_FILE, locked_run_directory

    victim = tmp_path / "thesis.txt"
    victim.write_text("My thesis")
    out = tmp_path / "out"
    (out / "predictions").mkdir(parents=True)
    os.link(victim, out / "predictions" / "boolq.jsonl")
    with pytest.raises(ValueError, match=r"holds links \('.*predictions/boolq.jsonl'"):
        refuse_links(out)
    (out / "predictions" / "boolq.jsonl").unlink()
    os.link(victim, out / LOCK_FILE)
    with pytest.raises(OSError, match="has other hard links"):
        with locked_run_directory(out):
            pass
    assert victim.read_text() == "My thesis"
    (out / LOCK_FILE).unlink()
    refuse_links(out)
    hidden = out / "trainer"
    (hidden / "checkpoint-2").mkdir(parents=True)
    real_scandir = os.scandir

    def scandir(path="."):  # a folder of mode 0100 (enter, not list), as root cannot make one
        if Path(path) == hidden:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "scandir", scandir)
        with pytest.raises(PermissionError, match=r"cannot list \('.*trainer': Permission denied\)"):
            refuse_links(out)


def test_the_commands_that_write_a_report_from_records_refuse_links_too(tmp_path: Path) -> None:
    from fira_train.analysis.variance import run_variance_analysis
    from fira_train.sweep.driver import rewrite_report

    out = tmp_path / "out"
    out.mkdir()
    (out / "lr.png").symlink_to(tmp_path / "victim")
    with pytest.raises(ValueError, match="holds links"):
        rewrite_report(out)
    with pytest.raises(ValueError, match="holds links"):
        run_variance_analysis(out)
    assert not (tmp_path / "victim").exists()


def test_only_what_a_run_writes_must_be_free_of_links_where_the_user_keeps_files_beside(tmp_path: Path) -> None:
    """A folder of the user's (a checkout with hard-linked objects, a data link) given as --out
    with --overwrite keeps their files: only the names the run writes are looked at."""
    from fira_train.files import refuse_links
    from fira_train.run.run_files import WRITTEN

    out = tmp_path / "out"
    (out / ".git" / "objects").mkdir(parents=True)
    (tmp_path / "blob").write_text("x")
    os.link(tmp_path / "blob", out / ".git" / "objects" / "ab")
    (out / "data_link").symlink_to(tmp_path)
    refuse_links(out, WRITTEN)
    with pytest.raises(ValueError, match="holds links"):
        refuse_links(out)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step_00000001").symlink_to(tmp_path)
    with pytest.raises(ValueError, match=r"holds links \('.*checkpoints/step_00000001'"):
        refuse_links(out, WRITTEN)
    (out / "checkpoints" / "step_00000001").unlink()
    (out / "summary.json.tmp").symlink_to(tmp_path / "blob")  # a write interrupted is the run's too
    with pytest.raises(ValueError, match="summary.json.tmp"):
        refuse_links(out, WRITTEN)


def test_what_vanishes_while_a_folder_is_looked_at_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    """Another process's temp file or checkpoint folder, gone between the listing and the look
    (memory --measure --append side by side; a second run into a busy folder, which the lock then
    refuses with its own message)."""
    from fira_train.files import refuse_links

    out = tmp_path / "out"
    (out / "checkpoints" / ".tmp-step_00000002-7").mkdir(parents=True)
    (out / "memory.json.tmp").write_text("{}")
    real_scandir, real_stat = os.scandir, Path.stat

    def scandir(path="."):
        if Path(path).name.startswith(".tmp-step"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    def stat(self, *args, **kwargs):
        if self.name == "memory.json.tmp":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(Path, "stat", stat)
    refuse_links(out)


@pytest.fixture
def no_hang():
    """A test that would block forever (a FIFO opened or read with nobody at its other end) fails
    after 20 seconds instead."""
    import signal

    def stuck(signum, frame):
        raise TimeoutError("blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifos_sockets_and_devices_below_a_folder_are_refused(tmp_path: Path, no_hang) -> None:
    """A FIFO planted as metrics.jsonl hung `pretrain --resume` forever: refuse_links let it through."""
    import socket

    from fira_train.files import refuse_links

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    refuse_links(out)
    os.mkfifo(out / "metrics.jsonl")
    with pytest.raises(ValueError, match=rf"^'{out}' holds entries that are neither files nor folders "
                                         rf"\('{out / 'metrics.jsonl'}': a FIFO, a socket or a device\): fira-train "
                                         "makes none"):
        refuse_links(out)
    refuse_links(out, names=["config.json"])  # only what a command writes, where the user keeps files beside
    os.remove(out / "metrics.jsonl")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(out / "checkpoints" / "s"))
        with pytest.raises(ValueError, match="neither files nor folders"):
            refuse_links(out)
    finally:
        server.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_lock_and_the_metrics_never_open_a_fifo_that_appears_later(tmp_path: Path, no_hang) -> None:
    """After refuse_links looked: the open for writing waited for a reader, forever."""
    from fira_train.files import locked
    from fira_train.run.run_lock import LOCK_FILE, locked_run_directory

    out = tmp_path / "out"
    out.mkdir()
    for name in ("metrics.jsonl", LOCK_FILE, ".memory.lock"):
        os.mkfifo(out / name)
    with pytest.raises(ValueError, match=rf"^'{out / 'metrics.jsonl'}' is not a file \(a FIFO, a socket or a device\)"):
        MetricsLog(out, tensorboard=False)
    with pytest.raises(ValueError, match="is not a file"):
        with locked_run_directory(out):
            pass
    with pytest.raises(ValueError, match="is not a file"):
        with locked(out / ".memory.lock"):
            pass
    from fira_train.files import open_regular

    with pytest.raises(ValueError, match="'/dev/null' is not a file"):
        open_regular("/dev/null", os.O_WRONLY)
    fd = open_regular(tmp_path / "regular", os.O_WRONLY | os.O_CREAT)  # a file: opened, and blocking as usual
    try:
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_run_files_are_never_read_from_a_fifo_that_appears_later(tmp_path: Path, no_hang) -> None:
    """A FIFO planted as summary.json or metrics.jsonl while a run trains (after refuse_links
    looked) blocked the read that resumes or reports the run until a writer came: forever."""
    from fira_train.files import read_json_lines

    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.json", "metrics.jsonl"):
        os.mkfifo(out / name)
    with pytest.raises(ValueError, match=rf"^'{out / 'summary.json'}' is not a file \(a FIFO, a socket or a device\)"):
        read_json(out / "summary.json")
    with pytest.raises(ValueError, match="is not a file"):
        read_json_lines(out / "metrics.jsonl")
    with pytest.raises(ValueError, match="is not a file"):
        cut_back_json_lines(out / "metrics.jsonl", 3)
    with pytest.raises(ValueError, match="'/dev/zero' is not a file"):  # a device: endless bytes
        read_json("/dev/zero")
    # a checkpoint's state (hashed before it is loaded) and markers
    from fira_train.files import file_digest
    from fira_train.run.checkpoint import CheckpointError
    from fira_train.run.checkpoint_integrity import read_marker
    from fira_train.run.safe_load import load_dcp_metadata

    (out / "step").mkdir()
    for name in ("state.pt", "COMPLETE", ".metadata"):
        os.mkfifo(out / "step" / name)
    with pytest.raises(ValueError, match="is not a file"):
        file_digest(out / "step" / "state.pt")
    with pytest.raises(CheckpointError, match="is not a file"):
        read_marker(out / "step")
    with pytest.raises(ValueError, match="is not a file"):
        load_dcp_metadata(out / "step" / ".metadata")
    (out / "folder.json").mkdir()
    with pytest.raises(IsADirectoryError):  # as a plain read says it (callers tell it from damage)
        read_json(out / "folder.json")
    (tmp_path / "real.json").write_text('{"a": 1}')
    (out / "linked.json").symlink_to(tmp_path / "real.json")  # a read through a link writes nothing: followed
    assert read_json(out / "linked.json") == {"a": 1}
    (out / "bad.json").write_bytes(b"\xff")
    with pytest.raises(DamagedFileError, match="not UTF-8 text: byte 0xff at offset 0"):
        read_json(out / "bad.json")


def test_json_nested_too_deeply_is_a_damaged_file_not_a_recursion_error(tmp_path: Path) -> None:
    """A crafted run file of ``[`` repeated: json.loads raised RecursionError, a traceback where a
    damaged file is a one-line error (and a resume stopped at such a marker, not going past it)."""
    from fira_train.files import read_json_lines
    from fira_train.run import checkpoint as ckpt
    from fira_train.run import checkpoint_integrity, dist_checkpoint, run_files

    deep = "[" * 100_000
    path = tmp_path / "deep.json"
    path.write_text(deep)
    with pytest.raises(DamagedFileError, match="nested too deeply"):
        read_json(path)
    (tmp_path / "deep.jsonl").write_text('{"step": 1}\n' + deep + "\n")
    with pytest.raises(DamagedFileError, match="line 2 is not valid JSON: nested too deeply"):
        read_json_lines(tmp_path / "deep.jsonl")
    (tmp_path / "config.json").write_text(deep)
    assert not run_files.is_run_config(tmp_path / "config.json")

    step = ckpt.save_checkpoint(tmp_path / "run", 1, {"step": 1})
    (step / ckpt.MARKER).write_text(deep)
    assert not dist_checkpoint.is_dcp_checkpoint(step)
    with pytest.raises(ckpt.CheckpointError, match="no valid COMPLETE marker"):
        ckpt.load_checkpoint(tmp_path / "run", step)
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        checkpoint_integrity.read_marker(step)


# ---------------------------------------------------------------- size caps on what is read


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that costs no disk (a crafted one of any apparent size)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def test_a_record_file_over_the_cap_is_refused_naming_it_its_size_and_the_limit(tmp_path: Path) -> None:
    """A crafted (or sparse) config.json, summary.json, marker or metrics.jsonl was read whole into
    memory: now its size is looked at first, and the error names the file, its size and the limit."""
    from fira_train.files import LINES_LIMIT, RECORD_LIMIT, FileTooLargeError, read_json_lines
    from fira_train.run import run_files

    size = RECORD_LIMIT + 1
    for name in ("config.json", "summary.json"):
        path = _sparse(tmp_path / name, size)
        with pytest.raises(FileTooLargeError, match=rf"^{path} is damaged \(too large: it is {size} bytes, over the "
                                                    rf"{RECORD_LIMIT} bytes fira-train reads .*\); delete it$"):
            read_json(path, hint="delete it")
    assert not run_files.is_run_config(tmp_path / "config.json")
    # a JSON-lines log grows with its run: read line by line, each line capped, the file much larger
    log = _sparse(tmp_path / "metrics.jsonl", LINES_LIMIT + 1)
    for read in (read_json_lines, lambda p: cut_back_json_lines(p, 3), lambda p: read_metrics(p.parent)):
        with pytest.raises(FileTooLargeError, match=rf"metrics\.jsonl is damaged \(too large: it is "
                                                    rf"{LINES_LIMIT + 1} bytes, over the {LINES_LIMIT} bytes"):
            read(log)
    _sparse(log, RECORD_LIMIT + 2)  # one line without end (zeros), under the file's cap: read up to the line's
    for read in (read_json_lines, lambda p: cut_back_json_lines(p, 3)):
        with pytest.raises(FileTooLargeError, match=rf"metrics\.jsonl is damaged \(too large: its line 1 is over the "
                                                    rf"{RECORD_LIMIT} bytes"):
            read(log)
    assert log.stat().st_size == RECORD_LIMIT + 2  # left as it was
    log.write_text('{"step": 1}\n{"step": 2}\n')  # legitimate files still load
    assert read_json_lines(log) == [{"step": 1}, {"step": 2}]
    (tmp_path / "summary.json").write_text('{"steps": 2}')
    assert read_json(tmp_path / "summary.json") == {"steps": 2}


def test_a_record_file_that_grows_after_its_size_was_looked_at_is_read_up_to_the_cap(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    from fira_train import files

    path = tmp_path / "summary.json"
    path.write_text('{"a": 1}')  # 8 bytes: at the cap, read (the cap passed: a default is bound when defined)
    assert files.read_regular_bytes(path, 8) == b'{"a": 1}'
    real = os.fstat
    sizes = iter([0])  # the size check sees it empty: it grew after the check

    def fstat(fd):
        info = real(fd)
        if fd != handle_fd[0]:
            return info
        return os.stat_result((*info[:6], next(sizes, info.st_size), *info[7:]))

    handle_fd = [None]
    real_open = files.open_regular

    def open_regular(*args, **kwargs):
        handle_fd[0] = real_open(*args, **kwargs)
        return handle_fd[0]

    path.write_text('{"a": 12345}')  # 12 bytes, over the cap, though the size check saw 0
    monkeypatch.setattr(files, "open_regular", open_regular)
    monkeypatch.setattr(os, "fstat", fstat)
    with pytest.raises(files.FileTooLargeError, match=r"too large: it is 12 bytes, over the 8 bytes"):
        files.read_regular_bytes(path, 8)


def test_checkpoint_records_over_the_cap_are_damaged_checkpoints(tmp_path: Path) -> None:
    """A marker or a DCP .metadata over the cap: a damaged checkpoint (a resume goes past it to an
    older one), never read whole."""
    from fira_train.files import RECORD_LIMIT
    from fira_train.run import checkpoint as ckpt
    from fira_train.run import checkpoint_integrity, dist_checkpoint
    from fira_train.run.safe_load import METADATA_LIMIT, load_dcp_metadata

    step = ckpt.save_checkpoint(tmp_path / "run", 1, {"step": 1})
    _sparse(step / ckpt.MARKER, RECORD_LIMIT + 1)
    assert not dist_checkpoint.is_dcp_checkpoint(step)
    with pytest.raises(ckpt.CheckpointError, match=rf"no valid COMPLETE marker .*too large: it is {RECORD_LIMIT + 1} "
                                                   rf"bytes, over the {RECORD_LIMIT} bytes"):
        ckpt.load_checkpoint(tmp_path / "run", step)
    with pytest.raises(ckpt.CheckpointError, match="unreadable .*too large"):
        checkpoint_integrity.read_marker(step)
    metadata = _sparse(step / ".metadata", METADATA_LIMIT + 1)
    with pytest.raises(ckpt.CheckpointError, match=rf"^checkpoint metadata '{metadata}' is too large: it is "
                                                   rf"{METADATA_LIMIT + 1} bytes, over the {METADATA_LIMIT} bytes"):
        load_dcp_metadata(metadata)


def test_a_report_without_a_line_end_is_not_read_whole_to_tell_who_wrote_it(tmp_path: Path) -> None:
    from fira_train.files import check_report_owner

    _sparse(tmp_path / "report.md", 1 << 40)  # one line of zeros, a TiB long
    with pytest.raises(FileExistsError, match="holds a report.md that"):
        check_report_owner(tmp_path, ("# Compare",), "compare")
