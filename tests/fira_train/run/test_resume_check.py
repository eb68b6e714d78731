"""--resume: a damaged latest checkpoint falls back to the newest intact one (saying so), and a
checkpoint's own record of the config must match, with or without OUT/config.json."""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fira_train.cli import main
from fira_train.config.overrides import config_to_dict
from fira_train.provenance import code_version
from fira_train.run import checkpoint as ckpt
from fira_train.run.metrics import read_metrics
from fira_train.run.run_dir import finished_with
from fira_train.run.training import resolve_device
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import micro_config

COMMON = ("optim.method=adamw", "train.steps=4", "train.save_every=1", "train.eval_every=0",
          "train.keep_last=5")


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path, caplog) -> None:
    straight = train(micro_config(tmp_path, *COMMON, out="straight"))
    config = micro_config(tmp_path, *COMMON)
    train(config)
    (tmp_path / "run" / "summary.json").unlink()  # as a run stopped while evaluating: unfinished
    root = tmp_path / "run" / "checkpoints"
    _flip_a_byte(root / "step_00000004" / "state.pt")
    (root / "step_00000003" / "state.pt").write_bytes(b"")  # and an empty one below it
    with caplog.at_level(logging.WARNING):
        resumed = train(config, resume="latest")
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step_00000004" in warning and "corrupted" in warning
    assert "step_00000003" in warning and "truncated" in warning
    assert "resuming from step_00000002" in warning and "--resume-step" in warning
    # steps 3 and 4 trained again: the same run as the one never interrupted
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert resumed["val_loss"] == straight["val_loss"]


def test_a_checkpoint_set_aside_by_a_killed_resave_is_put_back_and_resumed(tmp_path: Path, caplog) -> None:
    config = micro_config(tmp_path, *COMMON)
    straight = train(config)
    (tmp_path / "run" / "summary.json").unlink()
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000004").rename(root / ".old-step_00000004")  # killed between the two renames
    with caplog.at_level(logging.INFO):
        resumed = train(config, resume="latest")
    assert "put back" in caplog.text and "resumed" in caplog.text and "step 4" in caplog.text
    assert resumed["val_loss"] == straight["val_loss"] and resumed["steps"] == 4
    assert not (root / ".old-step_00000004").exists()


def test_a_resume_on_changed_data_is_refused(tmp_path: Path) -> None:
    """The same documents in another order (the same token count): the run went on silently on
    other batches with a retrained tokenizer (validation perplexity 113 -> 133 in one check)."""
    config = micro_config(tmp_path, *COMMON)
    train(config)
    (tmp_path / "run" / "summary.json").unlink()
    corpus = tmp_path / "corpus" / "corpus.txt"
    corpus.write_text("\n\n".join(reversed(corpus.read_text().split("\n\n"))))
    with pytest.raises(ValueError, match=r"the checkpoint was trained on other data than data.source='.*corpus' "
                                         r"gives now \(its text, split or tokenizer changed since"):
        train(config, resume="latest")


def test_a_resume_with_another_thread_count_warns_that_it_is_not_bit_exact(tmp_path: Path, caplog) -> None:
    config = micro_config(tmp_path, *COMMON)
    train(config)
    (tmp_path / "run" / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        train(config, resume=2)
    assert "train.num_threads" not in caplog.text  # the same count: exact, no word
    (tmp_path / "run" / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        train(micro_config(tmp_path, *COMMON, "train.num_threads=2"), resume=2)
    assert "with train.num_threads=1 (now 2): the run goes on equal to round-off, not bit for bit" in caplog.text


@pytest.mark.parametrize("settings, flips", [(("optim.method=adamw",), False),
                                              (("optim.method=fira", "optim.align_signs=true"), False),
                                              (("optim.method=fira", "optim.align_signs=false"), True),
                                              (("optim.method=fira-released",), True)])
def test_the_round_off_warning_names_sign_flips_only_where_the_run_has_raw_svd_signs(tmp_path: Path, caplog,
                                                                                     settings, flips) -> None:
    """A resume at another world size or thread count said that "with raw SVD signs (align_signs=false,
    the default) round-off can flip a basis vector" for AdamW, which projects nothing, and for a run
    with aligned signs, which the caveat does not touch."""
    from fira_train.run.resume_check import warn_round_off

    config = micro_config(tmp_path, *settings)
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), micro_config(tmp_path, *settings, "train.num_threads=2"),
                       Path("step_00000002"))
    assert "with train.num_threads=1 (now 2): the run goes on equal to round-off" in caplog.text
    assert ("with raw SVD signs (optim.align_signs=false) round-off can flip a basis vector" in caplog.text) is flips
    assert "the default" not in caplog.text


@pytest.mark.parametrize("settings", [("optim.method=fira-only-scaling-random",),
                                      ("optim.method=fira", "optim.projector=random"),
                                      ("optim.method=galore", "optim.projector=randomized")])
def test_the_round_off_warning_names_no_sign_flips_without_an_svd_projector(tmp_path: Path, caplog, settings) -> None:
    """Raw signs (optim.align_signs=false) with a random basis, or the warm-started randomized one
    (aligned by construction), have no SVD basis vector for round-off to flip: the warning said
    they did."""
    from fira_train.run.resume_check import warn_round_off

    config = micro_config(tmp_path, *settings, "optim.align_signs=false")
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), micro_config(tmp_path, *settings, "optim.align_signs=false",
                                                            "train.num_threads=2"), Path("step_00000002"))
    assert "with train.num_threads=1 (now 2): the run goes on equal to round-off" in caplog.text
    assert "flip" not in caplog.text


def test_a_resume_with_other_default_threads_warns_too(tmp_path: Path, caplog) -> None:
    """train.num_threads=0 takes torch's default count, which depends on the machine and on
    OMP_NUM_THREADS: the checkpoint records the count it ran with, and a resume with another one
    says it is not bit-exact, as for a changed train.num_threads."""
    threads = torch.get_num_threads()
    config = micro_config(tmp_path, *COMMON, "train.num_threads=0")
    try:
        torch.set_num_threads(1)
        train(config)
        state = torch.load(ckpt.find_checkpoint(tmp_path / "run", 2) / "state.pt", weights_only=True)
        assert state["environment"] == {"threads": 1, "world_size": 1, "device": resolve_device(config).type,
                                        "code": code_version()}
        (tmp_path / "run" / "summary.json").unlink()
        with caplog.at_level(logging.WARNING):
            train(config, resume=2)
        assert "equal to round-off" not in caplog.text  # the same count: exact, no word
        (tmp_path / "run" / "summary.json").unlink()
        torch.set_num_threads(2)
        with caplog.at_level(logging.WARNING):
            train(config, resume=2)
        assert "with threads 2 (the checkpoint's: 1): the run goes on equal to round-off" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_a_resume_on_another_device_kind_than_the_checkpoints_warns(tmp_path: Path, caplog) -> None:
    """train.device=auto records "auto" for a GPU and a CPU run alike; the checkpoint's environment
    record says which it was (a CPU fp32 run went on in bf16 on a GPU without a word)."""
    from fira_train.run.resume_check import environment_record, warn_round_off

    config = micro_config(tmp_path, *COMMON)
    here = environment_record(config, 1)
    other = "cuda" if here["device"] == "cpu" else "cpu"
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), config, Path("step_00000002"), {**here, "device": other}, 1)
    assert (f"resuming from step_00000002 on {here['device']}, where the checkpoint trained on {other} (under "
            "train.precision=auto another precision too") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), config, Path("step_00000002"), here, 1)
    assert caplog.text == ""


def test_a_resume_from_a_checkpoint_of_other_code_warns_naming_both(tmp_path: Path, caplog) -> None:
    from fira_train.run.resume_check import environment_record, warn_round_off

    config = micro_config(tmp_path, *COMMON)
    here = environment_record(config, 1)
    older = {**here["code"], "source": "0123456789abcdef", "commit": "f" * 40, "modified": True}
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), config, Path("step_00000002"), {**here, "code": older}, 1)
    assert (f"resuming from step_00000002, written by other code (source 0123456789abcdef (git ffffffffff, "
            f"modified) against this code's source {code_version()['source']}") in caplog.text
    caplog.clear()
    no_record = {name: value for name, value in here.items() if name != "code"}  # an older checkpoint
    with caplog.at_level(logging.WARNING):
        warn_round_off(config_to_dict(config), config, Path("step_00000002"), no_record, 1)
    assert caplog.text == ""


def test_no_intact_checkpoint_names_them_all(tmp_path: Path, capsys) -> None:
    config = micro_config(tmp_path, *COMMON[:2], "train.steps=2", "train.save_every=1", "train.keep_last=5")
    train(config)
    (tmp_path / "run" / "summary.json").unlink()  # as a run stopped while evaluating: unfinished
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        _flip_a_byte(root / f"step_{step:08d}" / "state.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"no intact checkpoint .*step_00000002: .*step_00000001: "
                                                   r".*--resume-step"):
        train(config, resume="latest")
    assert main(["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "2", "--out",
                 str(tmp_path / "run"), "--resume", "--data", config.data.source,
                 f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300", "data.val_fraction=0.1",
                 "train.progress=false", "train.tensorboard=false", "train.save_every=1",
                 "train.keep_last=5"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no intact checkpoint" in err


def test_resume_checks_the_checkpoints_own_config_without_config_json(tmp_path: Path, capsys) -> None:
    """The reviewer's case: a fira rank-16 run, config.json gone, resumed as galore rank 8."""
    config = micro_config(tmp_path, "optim.method=fira", "train.steps=2", "train.eval_every=0")
    train(config)
    out = tmp_path / "run"
    (out / "config.json").unlink()
    flags = ["--recipe", "micro", "--steps", "2", "--out", str(out), "--data", config.data.source,
             f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300", "data.val_fraction=0.1",
             "train.progress=false", "train.tensorboard=false", "train.num_threads=1", "train.eval_every=0"]
    code = main(["pretrain", "--method", "galore", "--rank", "8", *flags, "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert len(err.splitlines()) == 1
    assert "optim.method='fira' (now 'galore')" in err and "optim.rank=16 (now 8)" in err
    assert not (out / "config.json").exists()  # the refused resume left the run as it was
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    # the right settings still resume (nothing left to train)
    assert main(["pretrain", "--method", "fira", *flags, "--resume"]) == 0


def _dcp_checkpoints(out: Path, config, steps: tuple[int, ...]) -> Path:
    """DCP checkpoints of the tiny model under OUT/checkpoints, recording ``config``."""
    from fira_train.run import dist_checkpoint
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "adamw")
    for step in steps:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_checkpoint.save_checkpoint(out / "checkpoints", step, model, optimizer, extra={"step": step},
                                            record={"config": config_to_dict(config)})
    return out / "checkpoints"


def test_dcp_checkpoints_fall_back_and_check_their_config_record(tmp_path: Path, caplog) -> None:
    from fira_train.run.resume_check import choose_checkpoint

    config = micro_config(tmp_path, "optim.method=adamw")
    out = tmp_path / "dcp"
    root = _dcp_checkpoints(out, config, (1, 2, 3))
    assert choose_checkpoint(out, "latest", config) == (root / "step_00000003", None, [])
    # a memory lever changed: read off the DCP marker's config record
    levers = micro_config(tmp_path, "optim.method=adamw", "train.activation_checkpointing=true")
    assert choose_checkpoint(out, "latest", levers) == (root / "step_00000003", None, ["train.activation_checkpointing"])
    _flip_a_byte(root / "step_00000003" / "__0_0.distcp")
    (root / "step_00000002" / ".metadata").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(out, "latest", config) == (root / "step_00000001", None, [])
    warning = caplog.records[-1].getMessage()
    assert "__0_0.distcp' is corrupted" in warning and ".metadata' is truncated" in warning
    with pytest.raises(ckpt.CheckpointError, match="corrupted"):
        choose_checkpoint(out, 3, config)  # asked for by step: no fallback
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # another thread count: one warning, for the checkpoint chosen
        choose_checkpoint(out, "latest", micro_config(tmp_path, "optim.method=adamw", "train.num_threads=2"))
    rounded = [r.getMessage() for r in caplog.records if "equal to round-off" in r.getMessage()]
    assert len(rounded) == 1 and rounded[0].startswith("resuming from step_00000001 with train.num_threads=1")
    other = micro_config(tmp_path, "optim.method=galore", "optim.rank=8")
    with pytest.raises(ValueError, match=r"optim\.method='adamw' \(now 'galore'\)"):
        choose_checkpoint(out, "latest", other)


def test_single_file_checkpoints_record_the_config(tmp_path: Path) -> None:
    from fira_train.config.overrides import config_from_dict

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    train(config)
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config_from_dict(state["config"]) == config_from_dict(saved)  # the run's config, lr resolved


def test_a_check_of_the_records_alone_maps_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """compare --resume, sweep --reuse and analyze --reuse check every run's newest checkpoint
    before they start one (resume_check.checkpoint_refusal), and rank 0 picks the checkpoint for
    the other ranks: only its records are read, so its tensors are mapped, not loaded whole into
    memory; the resume itself loads them."""
    from fira_train.config.resolve import resolved
    from fira_train.run.resume_check import checkpoint_refusal, choose_checkpoint

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    train(config)
    asked = []
    load = ckpt.load_checkpoint
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda *a, mmap=False: asked.append(mmap) or load(*a, mmap=mmap))
    assert checkpoint_refusal(tmp_path / "run", resolved(config)) is None
    path, state, _ = choose_checkpoint(tmp_path / "run", "latest", resolved(config))  # a resume's: loaded whole
    assert asked == [True, False] and state is not None and path.name == "step_00000001"


def test_resuming_a_finished_run_keeps_its_summary(tmp_path: Path) -> None:
    """Nothing to train: the summary stands (a sitting of loading and evaluating replaced its
    throughput, wall time and peak memory); --resume-step still trains again from a checkpoint."""
    config = micro_config(tmp_path, *COMMON)
    summary = train(config)
    written = (tmp_path / "run" / "summary.json").read_bytes()
    assert train(config, resume="latest") == json.loads(written)
    assert (tmp_path / "run" / "summary.json").read_bytes() == written
    again = train(config, resume=2)
    assert again["val_loss"] == summary["val_loss"] and again["sittings"] == 2


def test_a_finished_run_on_other_data_is_neither_kept_nor_reused(tmp_path: Path) -> None:
    """The same config on a corpus whose text, split or tokenizer changed since (a package update
    of the tokenizer recipe): --resume, compare/sweep/analyze reuse refuse the finished run
    instead of keeping numbers measured on other data. A summary from before corpora were
    fingerprinted is compared by its tokenizer and split sizes."""
    from fira_train.data.build import build_corpus
    from fira_train.run.run_dir import finished_with

    config = micro_config(tmp_path, *COMMON)
    train(config)
    run = tmp_path / "run"
    data = build_corpus(config.data).describe()
    assert data["corpus"] and json.loads((run / "summary.json").read_text())["data"] == data
    assert finished_with(config, run, data)

    summary = json.loads((run / "summary.json").read_text())
    digest, corpus = summary["data"]["token_digest"], summary["data"]["corpus"]
    summary["data"]["token_digest"] = "0" * 32  # trained on other token ids
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"trained on other data than data.source=.*token_digest='0000"):
        train(config, resume="latest")
    with pytest.raises(ValueError, match="train it again with --overwrite"):
        finished_with(config, run, data)
    assert finished_with(config, run)  # no data given: the config alone (the check is the caller's)

    # the same ids from another tokenizer file (a tokenizers release writes it otherwise): kept
    summary["data"].update(token_digest=digest, corpus="0" * 32)
    (run / "summary.json").write_text(json.dumps(summary))
    assert finished_with(config, run, data)

    del summary["data"]["token_digest"]  # a summary written before token digests: its fingerprint decides
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"cannot tell\): corpus='0000"):
        finished_with(config, run, data)
    summary["data"]["corpus"] = corpus
    (run / "summary.json").write_text(json.dumps(summary))
    assert finished_with(config, run, data)

    del summary["data"]["corpus"]  # a summary written before fingerprints: tokenizer and sizes
    (run / "summary.json").write_text(json.dumps(summary))
    assert finished_with(config, run, data)
    summary["data"]["tokenizer"] = "bpe300-another"
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"tokenizer='bpe300-another' \(now 'bpe300-"):
        finished_with(config, run, data)


def test_a_damaged_summary_of_a_finished_run_says_how_to_rebuild_it(tmp_path: Path) -> None:
    """The hint said to delete the whole run; the final checkpoint evaluates it again."""
    config = micro_config(tmp_path, *COMMON)
    summary = train(config)
    (tmp_path / "run" / "summary.json").write_text('{"recipe": ')
    with pytest.raises(ValueError, match="delete summary.json and run with --resume again"):
        train(config, resume="latest")
    (tmp_path / "run" / "summary.json").unlink()
    trained = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    again = train(config, resume="latest")
    assert again["val_loss"] == summary["val_loss"] and again["steps"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == trained == [1, 2, 3, 4]


def test_a_resumed_run_reports_its_wall_time_and_peak_over_every_sitting(tmp_path: Path) -> None:
    config = micro_config(tmp_path, *COMMON)
    train(config)
    run = tmp_path / "run"
    first = ckpt.load_checkpoint(run, ckpt.find_checkpoint(run, 2))["progress"]
    (run / "summary.json").unlink()  # stopped after step 2's checkpoint
    for step in (3, 4):
        shutil.rmtree(ckpt.find_checkpoint(run, step))
    resumed = train(config, resume="latest")
    assert first["sittings"] == 1 and resumed["sittings"] == 2
    # the second sitting's wall time, added to the first's, holds at least its own training time
    assert resumed["wall_time_s"] - first["wall_time_s"] >= resumed["train_time_s"] - first["train_time_s"] > 0
    assert resumed["peak_memory_bytes"] >= first["peak_memory_bytes"] > 0
    assert first["peak_memory_kind"] == resumed["peak_memory_kind"]


def _stopped_at(run: Path, step: int, progress: Callable[[dict], dict]) -> None:
    """``run`` (finished) as if stopped right after step ``step``'s checkpoint (its summary and
    later checkpoints gone), that checkpoint's progress record replaced by ``progress(record)``."""
    (run / "summary.json").unlink()
    for path in [p for s, p in ckpt.complete_checkpoints(run) if s > step]:
        shutil.rmtree(path)
    path = ckpt.find_checkpoint(run, step)
    state = ckpt.load_checkpoint(run, path)
    state["progress"] = progress(state["progress"])
    shutil.rmtree(path)
    ckpt.save_checkpoint(run, step, state)


def test_a_checkpoint_without_the_totals_resumes_with_the_sittings_unknown(tmp_path: Path) -> None:
    """One written before the totals were kept: its earlier sittings cannot be counted."""
    config = micro_config(tmp_path, *COMMON)
    train(config)
    _stopped_at(tmp_path / "run", 2, lambda progress: {k: progress[k] for k in ("tokens", "train_time_s")})
    assert train(config, resume="latest")["sittings"] is None


def test_a_checkpoint_is_checked_by_the_data_record_it_has(caplog) -> None:
    """Token digests decide where both sides have one (the same ids from a tokenizer file that a
    tokenizers release writes otherwise resume); a checkpoint from before them is compared by its
    fingerprint, and one from before fingerprints cannot be checked: said, not silent."""
    from types import SimpleNamespace

    from fira_train.run.state import check_corpus, corpus_record

    stream = SimpleNamespace(corpus="0123456789abcdef", token_digest="aaaa")
    assert corpus_record(stream) == {"corpus": "0123456789abcdef", "token_digest": "aaaa"}
    assert corpus_record(SimpleNamespace(corpus=None, token_digest=None)) == {}
    with caplog.at_level(logging.WARNING):
        check_corpus({"corpus": "0123456789abcdef", "token_digest": "aaaa"}, stream, "x.txt")
        check_corpus({"corpus": "fedcba9876543210", "token_digest": "aaaa", "step": 3}, stream, "x.txt")
        check_corpus({"corpus": "0123456789abcdef"}, stream, "x.txt")
        assert not caplog.text
        check_corpus({}, stream, "x.txt")
    assert "records no fingerprint of its data" in caplog.text and "'x.txt'" in caplog.text
    with pytest.raises(ValueError, match=r"changed since: token_digest='bbbb' \(now 'aaaa'\)"):
        check_corpus({"corpus": "0123456789abcdef", "token_digest": "bbbb"}, stream, "x.txt")
    with pytest.raises(ValueError, match=r"corpus='fedcba9876543210' \(now '0123456789abcdef'\)"):
        check_corpus({"corpus": "fedcba9876543210"}, stream, "x.txt")


def _decided_worker(rank: int, world: int, fail: bool | str) -> str:
    import errno
    from argparse import Namespace

    from fira_train.run.parallel import DistributedEnv
    from fira_train.run.resume_check import decided_on_rank_zero
    from fira_train.user_errors import describe

    def decide():
        assert rank == 0  # only rank 0 reads the run directory
        if fail == "permission":
            raise PermissionError(errno.EACCES, "Permission denied", "/runs/x/summary.json")
        if fail:
            raise ValueError("summary.json is damaged")
        return {"val_loss": 1.5}

    try:
        return repr(decided_on_rank_zero(DistributedEnv(rank, world, rank, torch.device("cpu"), "gloo"), decide))
    except (ValueError, OSError) as err:
        from fira_train.run.launch import SAME_ON_EVERY_RANK

        if isinstance(err, OSError):  # the command line's one line, as rank 0's own error gives it
            return f"{type(err).__name__}: {describe(err, Namespace(command='pretrain', out='/runs/x', overrides=[]))}"
        return f"raised: {err}" + (" (rank 0 prints it)" if getattr(err, SAME_ON_EVERY_RANK, False) else "")


@pytest.mark.timeout(60)
def test_what_rank_zero_decides_reaches_every_rank_errors_included(tmp_path: Path) -> None:
    """The finished-run check broadcast rank 0's answer without its errors: a damaged
    summary.json raised on rank 0 while the others waited in the broadcast until the timeout.
    Every rank raises the one error, marked so that rank 0 alone prints it (it was printed once
    per process)."""
    from tests.multiprocess import run_ranks

    assert run_ranks(_decided_worker, 2, tmp_path, False, timeout=50) == ["{'val_loss': 1.5}"] * 2
    assert (run_ranks(_decided_worker, 2, tmp_path / "fail", True, timeout=50)
            == ["raised: summary.json is damaged (rank 0 prints it)"] * 2)
    # an OSError keeps its type, errno and file on the other ranks (it was a RuntimeError of its
    # text there, which the command line printed as a traceback)
    denied = run_ranks(_decided_worker, 2, tmp_path / "denied", "permission", timeout=50)
    assert denied[0] == denied[1] and denied[0].startswith("PermissionError: cannot write /runs/x/summary.json: "
                                                           "Permission denied"), denied


@pytest.mark.parametrize("lever", ["train.activation_checkpointing=true", "optim.step_in_backward=true"])
def test_a_resume_may_change_a_memory_lever_and_goes_on_bit_for_bit(tmp_path: Path, caplog, lever: str) -> None:
    """A run that ran out of memory resumes with activation checkpointing or updates in the
    backward pass: the same weights step by step, and the peak memory of the new setting alone."""
    common = ("optim.method=fira", "optim.update_proj_gap=2", "train.steps=5", "train.save_every=1",
              "train.eval_every=0", "train.keep_last=5", "train.grad_clip=0")
    straight = train(micro_config(tmp_path, *common, out="straight"))
    train(micro_config(tmp_path, *common))
    run = tmp_path / "run"
    # stopped after step 3's checkpoint (steps 4 and 5 cross a refresh); the earlier setting's
    # peak, not this one's
    _stopped_at(run, 3, lambda progress: {**progress, "peak_memory_bytes": 10 ** 15})
    changed = micro_config(tmp_path, *common, lever)
    with caplog.at_level(logging.WARNING):
        resumed = train(changed, resume="latest")
    key = lever.split("=")[0]
    assert f"resuming from step_00000003 with {key}=False (now True): the weights go on" in caplog.text
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert resumed["val_loss"] == straight["val_loss"] and resumed["sittings"] == 2
    assert 0 < resumed["peak_memory_bytes"] < 10 ** 15
    section, name = key.split(".")
    assert json.loads((run / "config.json").read_text())[section][name] is True
    # finished: nothing left to train with the other setting, whose summary it would then be, with
    # the memory of loading and evaluating the run: refused from the last checkpoint however asked
    refusal = rf"cannot resume from step_00000005 with {re.escape(key)}=True \(now False\): it is the run's last step"
    with pytest.raises(ValueError, match=refusal):
        train(micro_config(tmp_path, *common), resume="latest")
    with pytest.raises(ValueError, match=refusal):
        train(micro_config(tmp_path, *common), resume=5)
    kept = (run / "summary.json").read_text()
    (run / "summary.json").unlink()  # as a run stopped while evaluating: unfinished
    with pytest.raises(ValueError, match=refusal):
        train(micro_config(tmp_path, *common), resume="latest")
    (run / "summary.json").write_text(kept)
    assert train(changed, resume="latest") == json.loads(kept)


@pytest.mark.parametrize("micro", [2, 8])
def test_a_resume_may_change_the_micro_batch_size_and_trains_the_same_sequences(tmp_path: Path, caplog,
                                                                               micro: int) -> None:
    """A run that ran out of memory resumes with smaller micro-batches (or one that has room,
    with larger): the same sequences in every step, the weights equal to round-off, the data
    stream cut as the first sitting cut it (across epochs: the stream's own tests). It was
    refused as another config."""
    common = ("optim.method=fira", "optim.update_proj_gap=2", "train.steps=6", "train.save_every=1",
              "train.eval_every=0", "train.keep_last=6", "train.batch_size=8", "train.micro_batch_size=4")
    straight = train(micro_config(tmp_path, *common, out="straight"))
    train(micro_config(tmp_path, *common))
    run = tmp_path / "run"
    _stopped_at(run, 3, lambda progress: progress)
    with caplog.at_level(logging.WARNING):
        resumed = train(micro_config(tmp_path, *common, f"train.micro_batch_size={micro}"), resume="latest")
    assert (f"resuming from step_00000003 with train.micro_batch_size=4 (now {micro}): the same sequences go "
            "through each step in other micro-batches: the weights go on equal to round-off") in caplog.text
    losses = [r["loss"] for r in read_metrics(run)]
    assert losses[:3] == [r["loss"] for r in read_metrics(tmp_path / "straight")][:3]
    assert losses[3:] == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "straight")][3:], rel=1e-4)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-4) and resumed["sittings"] == 2
    stream = ckpt.load_checkpoint(run, ckpt.find_checkpoint(run, 6))["data"]
    assert stream["batch_size"] == 8  # the epochs are cut in whole steps, whatever the micro-batch size
    # so a run at that micro-batch size from the start trains the same sequences (it is the run
    # that compare or sweep would reuse this one for)
    fresh = train(micro_config(tmp_path, *common, f"train.micro_batch_size={micro}", out="fresh"))
    assert [r["loss"] for r in read_metrics(tmp_path / "fresh")] == pytest.approx(losses, rel=1e-4)
    assert fresh["val_loss"] == pytest.approx(resumed["val_loss"], rel=1e-4)


def test_a_micro_batch_size_given_as_the_whole_batch_is_no_lever_change(tmp_path: Path, caplog) -> None:
    """train.micro_batch_size=None and =train.batch_size are one setting: a resume between them
    warned of round-off and dropped the earlier sittings' peak memory."""
    common = (*COMMON, "train.batch_size=8")
    train(micro_config(tmp_path, *common, "train.micro_batch_size=8"))
    (tmp_path / "run" / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        train(micro_config(tmp_path, *common, "train.micro_batch_size=none"), resume=2)
    assert "train.micro_batch_size" not in caplog.text
    # finished: the same run (reused, and its summary kept on a resume), not one to train again
    kept = (tmp_path / "run" / "summary.json").read_text()
    assert finished_with(micro_config(tmp_path, *common, "train.micro_batch_size=8"), tmp_path / "run")
    train(micro_config(tmp_path, *common, "train.micro_batch_size=8"), resume="latest")
    assert (tmp_path / "run" / "summary.json").read_text() == kept


def test_a_step_of_more_sequences_than_the_corpus_names_train_batch_size(tmp_path: Path) -> None:
    """The epochs are cut in whole steps: a micro-batch that fits does not make such a step fit."""
    config = micro_config(tmp_path, *COMMON, "train.batch_size=100000", "train.micro_batch_size=4")
    with pytest.raises(ValueError, match=r"train.batch_size=100000: a step of 100000 sequences \(the epochs are "
                                         r"cut in whole steps, at any micro-batch size\) exceeds the \d+ training"):
        train(config)


def test_a_checkpoint_whose_stream_steps_do_not_divide_the_batch_is_refused_before_training(tmp_path: Path) -> None:
    """A checkpoint without a config record resumed at another train.batch_size trained on and
    failed only at its next save ("a state is saved where a batch of the saved size ends")."""
    from fira_train.run.resume_check import check_stream_cut

    config = micro_config(tmp_path, *COMMON, "train.batch_size=6", "train.micro_batch_size=6")
    with pytest.raises(ValueError, match=r"its data stream was cut in batches of 4 sequences, which "
                                         r"train.batch_size=6 cannot continue"):
        check_stream_cut({"batch_size": 4, "epoch": 0}, config, Path("step_00000002"))
    check_stream_cut({"batch_size": 3}, config, Path("step_00000002"))  # whole steps of it: continued
    check_stream_cut(None, config, Path("step_00000002"))  # nothing recorded: nothing to check


def test_the_same_checkpoint_without_a_lever_change_keeps_the_earlier_peak(tmp_path: Path) -> None:
    config = micro_config(tmp_path, *COMMON)
    train(config)
    _stopped_at(tmp_path / "run", 2, lambda progress: {**progress, "peak_memory_bytes": 10 ** 15})
    assert train(config, resume="latest")["peak_memory_bytes"] == 10 ** 15


def test_updates_in_the_backward_pass_do_not_change_on_resume_under_fp16(tmp_path: Path) -> None:
    """Under fp16 the checkpoint's loss scale is GradScaler's with a plain step and the handle's
    with step_in_backward: the two do not resume each other."""
    from fira_train.run.run_dir import resume_ignores

    assert "optim.step_in_backward" in resume_ignores(micro_config(tmp_path))
    assert "train.activation_checkpointing" in resume_ignores(micro_config(tmp_path))
    fp16 = micro_config(tmp_path, "train.precision=fp16")
    assert "optim.step_in_backward" not in resume_ignores(fp16)
    assert "train.activation_checkpointing" in resume_ignores(fp16)



def test_the_refused_change_of_updates_in_the_backward_pass_under_fp16_says_why(tmp_path: Path) -> None:
    """The refusal said only that resuming must reproduce the same run, of a lever that resumes
    with or without it elsewhere."""
    from fira_train.config.resolve import resolved
    from fira_train.run.run_dir import resume_refusal

    fp16 = resolved(micro_config(tmp_path, "train.precision=fp16"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_to_dict(fp16)))
    refusal = resume_refusal(tmp_path / "run", resolved(micro_config(tmp_path, "train.precision=fp16",
                                                                     "optim.step_in_backward=true")))
    assert refusal is not None and refusal.startswith("optim.step_in_backward=False (now True)")
    assert "under train.precision=fp16 a resume keeps the run's optim.step_in_backward" in refusal


def test_a_resume_refuses_a_run_folder_holding_links_before_writing_anything(tmp_path: Path, capsys) -> None:
    """A run folder from elsewhere: its lock file, a temp file or tb/ as a link to a file outside
    had the resume truncate or write that file."""
    config = micro_config(tmp_path, *COMMON)
    train(config)
    run = tmp_path / "run"
    victim = tmp_path / "victim"
    victim.write_text("SECRET")
    (run / ".fira-train.lock").unlink()
    (run / ".fira-train.lock").symlink_to(victim)
    (run / "summary.json.tmp").symlink_to(victim)
    args = ["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "4", "--out", str(run), "--resume",
            "--data", config.data.source, f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300",
            "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false", "train.save_every=1",
            "train.keep_last=5", "train.eval_every=0"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds links" in err and ".fira-train.lock" in err
    assert victim.read_text() == "SECRET"


def test_a_resume_may_change_how_the_optimizer_computes_its_step(tmp_path: Path, caplog) -> None:
    """``optim.implementation`` (and ``optim.host_refresh``) change how the step is computed, not
    its states: a run checkpointed with the fast path goes on with the reference one (off
    torch.compile, say), with a word on round-off; reusing a finished run stays strict."""
    fira = ("optim.method=fira", "optim.rank=4", *COMMON[1:])
    config = micro_config(tmp_path, *fira)
    train(config)
    (tmp_path / "run" / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        train(micro_config(tmp_path, *fira, "optim.implementation=reference"), resume=2)
    assert "with optim.implementation='fast' (now 'reference'): the run goes on equal to round-off" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
    run = tmp_path / "run"  # reused as finished only with the setting it finished with
    assert finished_with(micro_config(tmp_path, *fira, "optim.implementation=reference"), run)
    assert not finished_with(micro_config(tmp_path, *fira), run)


def test_a_resume_from_the_last_step_refuses_another_implementation(tmp_path: Path) -> None:
    """From the run's last step the resume trains nothing: it only recorded the finished run as
    trained with the new optim.implementation, which reuse (finished_with) then took for a run of
    that setting, though not one step ran with it."""
    fira = ("optim.method=fira", "optim.rank=4", *COMMON[1:])
    train(micro_config(tmp_path, *fira))
    with pytest.raises(ValueError, match=r"cannot resume from step_00000004 with optim.implementation='fast' "
                                         r"\(now 'reference'\): it is the run's last step"):
        train(micro_config(tmp_path, *fira, "optim.implementation=reference"), resume="latest")
    run = tmp_path / "run"
    assert finished_with(micro_config(tmp_path, *fira), run)
    assert not finished_with(micro_config(tmp_path, *fira, "optim.implementation=reference"), run)


class _NeedsTwo(Exception):
    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


def test_an_error_that_cannot_travel_between_ranks_goes_as_its_text() -> None:
    """Rank 0's error is pickled to the others: one that does not survive the round trip (an
    __init__ of other arguments) would fail on the receiving ranks, so it goes as a RuntimeError
    of its text; a picklable one goes as itself."""
    from fira_train.run.checkpoint_integrity import sendable

    sent = sendable(_NeedsTwo("a", "b"))
    assert type(sent) is RuntimeError and str(sent) == "_NeedsTwo: a and b"
    denied = PermissionError(13, "Permission denied", "/runs/x/summary.json")
    assert sendable(denied) is denied


def _fsdp2_resume_worker(rank: int, world: int, root: str) -> list:
    from fira_train.run.launch import SAME_ON_EVERY_RANK

    try:
        train(micro_config(Path(root), *COMMON, "train.parallel=fsdp2"), resume="latest")
    except ValueError as err:
        return [str(err), getattr(err, SAME_ON_EVERY_RANK, False)]
    return []


@pytest.mark.timeout(120)
def test_an_fsdp2_resume_of_a_one_process_checkpoint_is_refused_before_config_json_changes(tmp_path: Path) -> None:
    """`torchrun ... --parallel fsdp2 --resume` of a one-process run was refused once every rank
    had built its model, after config.json had been rewritten: the refused resume left the run
    recorded as an FSDP2 run (the module's rule: a refused resume leaves the run as it was), and
    each process printed the refusal."""
    from tests.multiprocess import run_ranks

    train(micro_config(tmp_path, *COMMON))
    (tmp_path / "run" / "summary.json").unlink()  # the run stopped after its checkpoint of step 2
    for step in (3, 4):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")
    saved = (tmp_path / "run" / "config.json").read_text()
    for message, marked in run_ranks(_fsdp2_resume_worker, 2, tmp_path / "w", str(tmp_path), timeout=100):
        assert "was written by a one-process run; FSDP2 resumes only from checkpoints of a --parallel run" in message
        assert marked is True
    assert (tmp_path / "run" / "config.json").read_text() == saved
