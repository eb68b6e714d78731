"""``train.parallel`` ddp / fsdp2: 2 gloo processes train like one process on the same global batch.

One 1-process reference run (module fixture) and one launch of 2 processes per mode, on the
``micro`` recipe cut to a few steps: the 2-process runs must give the reference's per-step
losses, validation loss and final weights to float32 round-off (the ranks sum their halves of
each batch in another order), and a 2-process DDP run stopped after a checkpoint and resumed
(with 2 processes, and with one from its DCP checkpoint) must continue as if never stopped.
"""

from __future__ import annotations

import json

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from fira_train.cli import SAME_ON_EVERY_RANK, build_parser, config_from_args
from fira_train.run.callbacks import TrainCallback
from fira_train.run.dist_checkpoint import is_dcp_checkpoint
from fira_train.run.metrics import read_metrics
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import micro_config
from tests.multiprocess import run_ranks

STEPS = 6  # Fira refreshes at steps 1 and 6 (micro: T = 5)
SAVE = 3
# 7 validation sequences in batches of 4: the last batch splits 2 / 1 over the two ranks.
# Aligned SVD signs: the ranks add their gradient halves in another order than one process,
# and with raw signs that round-off can flip a singular vector at a refresh, which moves the
# trajectory by more than round-off (the carried Adam moments are read in the flipped basis).
# Aligned, the runs agree to round-off, which is what these tests check.
COMMON = (f"train.steps={STEPS}", f"train.save_every={SAVE}", f"train.eval_every={SAVE}",
          "data.val_sequences=7", "optim.method=fira", "optim.align_signs=true")


def _config(root: Path, mode: str, out: str):
    return micro_config(Path(root), *COMMON, f"train.parallel={mode}", out=out)


class FinalParameters(TrainCallback):
    """Records the full parameters after the optimizer step ``steps`` (FSDP2 shards gathered)."""

    def __init__(self, steps: int = STEPS) -> None:
        self.steps = steps
        self.params: dict[str, torch.Tensor] = {}
        self.initial: dict[str, torch.Tensor] = {}

    def before_step(self, step, model, optimizer, loss) -> None:
        if step == 1:
            self.initial = _full(model)

    def after_step(self, step, model, optimizer, loss) -> None:
        if step == self.steps:
            self.params = _full(model)


def _full(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


class _Stop(Exception):
    pass


class StopBefore(TrainCallback):
    """Raises at step ``step`` before its update: the run dies after the previous checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step, model, optimizer, loss) -> None:
        if step == self.step:
            raise _Stop


def _ddp_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    root = Path(root)
    try:  # several processes without --parallel: refused before anything is built
        train(_config(root, "none", "refused"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    straight = FinalParameters()
    summary = train(_config(root, "ddp", "ddp"), callbacks=[straight])
    # --resume of the finished run: kept, on every rank; once its summary records another
    # corpus, refused on every rank (rank 0 decides while the others wait)
    dist.barrier()  # rank 0 has written summary.json
    written = (root / "ddp" / "summary.json").read_text()
    kept = train(_config(root, "ddp", "ddp"), resume="latest") == json.loads(written)
    kept = kept and (root / "ddp" / "summary.json").read_text() == written
    dist.barrier()
    if rank == 0:
        (root / "ddp" / "summary.json").write_text(written.replace(summary["data"]["token_digest"], "f" * 32))
    dist.barrier()
    try:
        train(_config(root, "ddp", "ddp"), resume="latest")
        other_data = ""
    except ValueError as err:
        other_data = str(err)
    dist.barrier()
    if rank == 0:
        (root / "ddp" / "summary.json").write_text(written)
    config = _config(root, "ddp", "ddp_stopped")
    try:
        train(config, callbacks=[StopBefore(SAVE + 1)])
    except _Stop:
        pass
    if rank == 0:  # a copy of the stopped run for the 1-process resume in the test
        shutil.copytree(root / "ddp_stopped", root / "ddp_stopped_copy")
    dist.barrier()
    resumed = FinalParameters()
    resumed_summary = train(config, resume="latest", callbacks=[resumed])
    return {"refused": refused, "kept": kept, "other_data": other_data,
            "params": straight.params, "val_loss": summary["val_loss"],
            "resumed_params": resumed.params, "resumed_val_loss": resumed_summary["val_loss"]}


class RowsSeen(TrainCallback):
    """From step 2 on, the token ids of every training forward pass this rank runs."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.handle = None

    def before_step(self, step, model, optimizer, loss) -> None:
        if step == 1:
            def record(module, args, kwargs):
                if module.training:
                    self.batches.append(kwargs["input_ids"].detach().clone())

            self.handle = model.register_forward_pre_hook(record, with_kwargs=True)


def _fsdp2_worker(rank: int, world: int, root: str) -> dict:
    final, rows = FinalParameters(), RowsSeen()
    summary = train(_config(Path(root), "fsdp2", "fsdp2"), callbacks=[final, rows])
    rows.handle.remove()
    return {"params": final.params, "val_loss": summary["val_loss"], "batches": rows.batches}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 1-process run (it also builds the tokenizer cache that the ranks then read)."""
    root = tmp_path_factory.mktemp("parallel")
    final = FinalParameters()
    summary = train(_config(root, "none", "one"), callbacks=[final])
    return {"root": root, "params": final.params, "initial": final.initial, "val_loss": summary["val_loss"],
            "losses": [r["loss"] for r in read_metrics(root / "one")]}


def _assert_same_run(reference: dict, params: dict, val_loss: float, run_dir: Path | None = None) -> None:
    assert params.keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        # Relative to how far the weights moved: Adam-like updates divide by sqrt(v), so the
        # float32 round-off of a near-zero gradient (the ranks add their halves in another
        # order) becomes ~1e-5 of that element's step; a wrong batch, scale or reduction
        # moves the weights by whole steps.
        moved = (value - reference["initial"][name]).norm()
        assert (params[name] - value).norm() <= 5e-4 * moved, name
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-4, msg=name)
    assert val_loss == pytest.approx(reference["val_loss"], rel=1e-5)
    if run_dir is not None:
        records = read_metrics(run_dir)  # rank 0 alone wrote them: one record per step
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in records] == pytest.approx(reference["losses"], rel=1e-5)
        assert [r["val_loss"] for r in records if "val_loss" in r][-1] == pytest.approx(val_loss, abs=0)


@pytest.fixture(scope="module")
def ddp(reference):
    return run_ranks(_ddp_worker, 2, reference["root"] / "w-ddp", str(reference["root"]), timeout=100)


@pytest.mark.timeout(120)
def test_ddp_two_processes_equal_one_process(reference, ddp):
    root = reference["root"]
    for rank in ddp:
        _assert_same_run(reference, rank["params"], rank["val_loss"], root / "ddp")
    checkpoints = sorted((root / "ddp" / "checkpoints").glob("step_*"))
    assert [p.name for p in checkpoints] == ["step_00000003", "step_00000006"]
    assert all(is_dcp_checkpoint(p) for p in checkpoints)
    assert "--parallel ddp" in ddp[0]["refused"] and "'none'" in ddp[0]["refused"]
    assert all(rank["kept"] for rank in ddp)
    assert all("trained on other data" in rank["other_data"] for rank in ddp)


@pytest.mark.timeout(120)
def test_ddp_stopped_and_resumed_continues_identically(reference, ddp):
    """Stopped before step 4 (checkpoint at 3), resumed by 2 processes: the same weights and
    validation loss as the uninterrupted 2-process run, bit for bit; resumed by one process
    from the same DCP checkpoint: the same to round-off."""
    root = reference["root"]
    for rank in ddp:
        for name, value in rank["params"].items():
            assert torch.equal(rank["resumed_params"][name], value), name
        assert rank["resumed_val_loss"] == rank["val_loss"]
    records = read_metrics(root / "ddp_stopped")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    one = FinalParameters()
    copy = root / "ddp_stopped_copy"
    config = micro_config(root, *COMMON, "train.parallel=none", out="ddp_stopped_copy")
    summary = train(config, resume="latest", callbacks=[one])
    assert [r["step"] for r in read_metrics(copy)] == list(range(1, STEPS + 1))
    _assert_same_run(reference, one.params, summary["val_loss"])


#: Updates in the backward pass with fp16 loss scaling (the handle's own scale).
IN_BACKWARD = ("optim.step_in_backward=true", "train.grad_clip=0", "train.precision=fp16")


class MomentSums(TrainCallback):
    """The sum of |exp_avg| over the optimizer's state before each step: moments restarted
    from zero after a resume show at once."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}

    def before_step(self, step, model, optimizer, loss) -> None:
        self.sums[step] = sum(float(s["exp_avg"].float().abs().sum()) for s in optimizer.state.values()
                              if "exp_avg" in s)


def _ddp_in_backward_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    root = Path(root)
    straight, straight_sums = FinalParameters(), MomentSums()
    train(micro_config(root, *COMMON, "train.parallel=ddp", *IN_BACKWARD, out="sib"),
          callbacks=[straight, straight_sums])
    config = micro_config(root, *COMMON, "train.parallel=ddp", *IN_BACKWARD, out="sib_stopped")
    try:
        train(config, callbacks=[StopBefore(SAVE + 1), MomentSums()])
    except _Stop:
        pass
    if rank == 0:  # a copy of the stopped run for the 1-process resume in the test
        shutil.copytree(root / "sib_stopped", root / "sib_stopped_copy")
    dist.barrier()
    resumed, resumed_sums = FinalParameters(), MomentSums()
    train(config, resume="latest", callbacks=[resumed, resumed_sums])
    return {"params": straight.params, "sums": straight_sums.sums, "resumed_params": resumed.params,
            "resumed_sums": resumed_sums.sums}


@pytest.mark.timeout(150)
def test_ddp_in_backward_with_fp16_resumes_its_moments(reference):
    """DCP builds missing optimizer state by a step on zero gradients: under DDP with updates in
    the backward pass that step updated nothing, and the resumed run restarted Adam from zero
    moments; a one-process resume of the same checkpoint failed on the unscaled gradients."""
    root = reference["root"]
    for rank in run_ranks(_ddp_in_backward_worker, 2, root / "w-sib", str(root), timeout=130):
        assert rank["resumed_sums"] == {s: v for s, v in rank["sums"].items() if s > SAVE}
        for name, value in rank["params"].items():
            assert torch.equal(rank["resumed_params"][name], value), name
    one = FinalParameters()
    train(micro_config(root, *COMMON, "train.parallel=none", *IN_BACKWARD, out="sib_stopped_copy"),
          resume="latest", callbacks=[one])
    for name, value in rank["params"].items():  # the ranks' halves added in another order, in fp16
        torch.testing.assert_close(one.params[name], value, rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.timeout(120)
def test_fsdp2_two_processes_equal_one_process(reference):
    root = reference["root"]
    results = run_ranks(_fsdp2_worker, 2, root / "w-fsdp2", str(root), timeout=100)
    for rank in results:
        _assert_same_run(reference, rank["params"], rank["val_loss"], root / "fsdp2")
    assert all(is_dcp_checkpoint(p) for p in (root / "fsdp2" / "checkpoints").glob("step_*"))
    # Each rank trained on its own half of every micro-batch (micro: 4 sequences -> 2 each).
    zero, one = results[0]["batches"], results[1]["batches"]
    assert len(zero) == len(one) == 2 * (STEPS - 1)  # 2 micro-batches per step, steps 2..STEPS
    for a, b in zip(zero, one):
        assert a.shape[0] == b.shape[0] == 2
        assert not torch.equal(a, b)


def _rank_warnings_worker(rank: int, world: int, root: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(micro_config(Path(root), *COMMON, "train.parallel=ddp", "optim.rank=1000", "train.steps=1",
                           out="rank1000"))
    return [str(w.message) for w in caught if "rank=1000 is >= min(m, n)" in str(w.message)]


@pytest.mark.timeout(120)
def test_a_warning_of_the_config_is_given_by_rank_0_alone(reference):
    """The optimizer is built from the config and the model, the same on every rank: what it
    warns of (a rank above every matrix's size) was printed once per process."""
    root = reference["root"]
    warned = run_ranks(_rank_warnings_worker, 2, root / "w-warned", str(root), timeout=100)
    assert [len(messages) for messages in warned] == [1, 0]


def _nan_state_worker(rank: int, world: int, root: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(micro_config(Path(root), *COMMON, "train.parallel=ddp", out="nan-state"), resume="latest")
    return [str(w.message) for w in caught if "the state dict holds NaN or Inf" in str(w.message)]


@pytest.mark.timeout(150)
def test_a_warning_of_the_loaded_checkpoint_under_ddp_is_given_by_rank_0_alone(reference):
    """Every DDP rank loads the same whole state: the warning of NaN or Inf in the optimizer's
    state (a checkpoint an overflowing step left) was printed once per process."""
    from fira_train.files import file_digest

    root = reference["root"]
    out = root / "nan-state"
    shutil.copytree(root / "one", out)  # the one-process run, as if stopped after step SAVE
    (out / "summary.json").unlink()
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    checkpoint = out / "checkpoints" / f"step_{SAVE:08d}"
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    moments = next(s for s in state["optimizer"]["state"].values() if "exp_avg_sq" in s)
    moments["exp_avg_sq"].view(-1)[0] = float("inf")
    torch.save(state, checkpoint / "state.pt")
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker.update(size=(checkpoint / "state.pt").stat().st_size, sha256=file_digest(checkpoint / "state.pt"))
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    warned = run_ranks(_nan_state_worker, 2, root / "w-nan", str(root), timeout=130)
    assert [len(messages) for messages in warned] == [1, 0]


def _refusal(config) -> list | None:
    """What ``train(config)`` refused with (its message, and whether rank 0 alone is to print it), or None."""
    try:
        train(config)
    except ValueError as err:
        return [str(err), getattr(err, SAME_ON_EVERY_RANK, False)]
    return None


def _refused_worker(rank: int, world: int, root: str) -> list | None:
    return _refusal(micro_config(Path(root), *COMMON, "train.parallel=ddp", "train.steps=1",
                                 "train.micro_batch_size=1", out="refused-micro-batch"))


@pytest.mark.timeout(120)
def test_an_error_of_the_config_in_a_launch_is_marked_for_rank_0_to_print(reference):
    """A micro-batch that the processes cannot share: refused by every rank alike once the launch's
    size is known, and marked (same_on_every_rank) so that the command line prints it on rank 0
    alone; it was printed once per process."""
    root = reference["root"]
    for message, marked in run_ranks(_refused_worker, 2, root / "w-refused", str(root), timeout=100):
        assert "micro_batch_size=1 (the sequences of one forward pass) must divide by the 2" in message
        assert marked is True


def _mismatched_worker(rank: int, world: int, root: str) -> list | None:
    # each rank its own learning rate and steps (a script that passes each its own command line),
    # and its own thread count, which may differ
    config = micro_config(Path(root), *COMMON, "train.parallel=ddp", f"optim.lr={0.01 * (rank + 1)}",
                          f"train.steps={2 + rank}", f"train.num_threads={rank + 1}", out="mismatched")
    return _refusal(config)


@pytest.mark.timeout(120)
def test_processes_given_different_settings_are_refused_before_the_run(reference):
    """Ranks given different steps stopped gloo with "collective mismatch" (NCCL hangs); given
    different learning rates, each trained its replica with its own and the run recorded rank 0's.
    Now every rank refuses it alike, naming each setting and its value on each rank, before the
    run's folder is made."""
    root = reference["root"]
    for message, marked in run_ranks(_mismatched_worker, 2, root / "w-mismatched", str(root), timeout=100):
        assert message == ("the 2 processes of this launch were given different settings: optim.lr=0.01 on rank 0, "
                           "0.02 on rank 1; train.steps=2 on rank 0, 3 on rank 1; every process of a torchrun "
                           "launch must run the same command line")
        assert marked is True
    assert not (root / "mismatched").exists()


def _own_cache_worker(rank: int, world: int, root: str) -> float:
    # each machine of a multi-node launch its own cache folder (a disk of its own), the same data
    config = micro_config(Path(root), *COMMON, "train.parallel=ddp", "train.steps=2", "train.eval_every=2",
                          f"data.cache_dir={Path(root) / f'cache{rank}'}", out="own-cache")
    return train(config)["val_loss"]


@pytest.mark.timeout(120)
def test_processes_may_cache_the_data_in_folders_of_their_own(tmp_path):
    """data.cache_dir is where a process keeps its tokenizer and tokens, not a setting of the run
    (a resume may change it; what the ranks read is compared as data): machines of a multi-node
    launch each given a cache folder of their own were refused as given different settings."""
    import shutil

    from fira_train.data.build import build_corpus

    build_corpus(micro_config(tmp_path, f"data.cache_dir={tmp_path / 'cache0'}").data)
    shutil.copytree(tmp_path / "cache0", tmp_path / "cache1")  # built once, for speed: each rank reads its own
    losses = run_ranks(_own_cache_worker, 2, tmp_path / "w", str(tmp_path), timeout=100)
    assert losses[0] == losses[1]
    assert (tmp_path / "own-cache" / "summary.json").exists()


def _other_data_worker(rank: int, world: int, root: str) -> list | None:
    import os

    # one relative data.source read from each rank's own folder, as machines of a multi-node
    # launch each read a copy of their own
    os.chdir(Path(root) / f"node{rank}")
    config = micro_config(Path(root), *COMMON, "train.parallel=ddp", "train.steps=2", "data.source=corpus",
                          out="other-data")
    return _refusal(config)


@pytest.mark.timeout(120)
def test_processes_reading_different_data_are_refused_before_the_run(tmp_path):
    """Ranks whose data.source gave other text each trained on their rows of their own batches, and
    the run recorded rank 0's data: nothing said so. Now every rank refuses it alike."""
    from tests.fira_train.harness_fixtures import write_corpus

    for rank in range(2):
        write_corpus(tmp_path / f"node{rank}" / "corpus", seed=rank)
    for message, marked in run_ranks(_other_data_worker, 2, tmp_path / "w", str(tmp_path), timeout=100):
        assert message.startswith("the 2 processes of this launch read different data from data.source='corpus': "
                                  "corpus='"), message
        assert "' on rank 0, '" in message and "' on rank 1; token_digest='" in message
        assert message.endswith("every process must read the same corpus (on several machines, the same files at "
                                "the same path)")
        assert marked is True
    assert not (tmp_path / "other-data").exists()


def _other_tokenizer_file_worker(rank: int, world: int, root: str) -> float:
    if rank == 1:
        # another tokenizers release, which writes the same tokenizer's file otherwise: another
        # corpus fingerprint, the same ids
        from fira_train.data import build

        original = build.tokenizer_fingerprint
        build.tokenizer_fingerprint = lambda tokenizer: original(tokenizer) + "-written-otherwise"
    config = micro_config(Path(root), *COMMON, "train.parallel=ddp", "train.steps=2", "train.eval_every=2",
                          out="same-ids")
    return train(config)["val_loss"]


@pytest.mark.timeout(120)
def test_processes_reading_the_same_ids_under_other_corpus_fingerprints_train(tmp_path):
    """The token digest decides where every rank has one, as on a resume (a checkpoint's record of
    its data): ranks whose tokenizer file was written otherwise (another tokenizers release) read
    the same ids under another corpus fingerprint, and were refused as reading different data."""
    from fira_train.data.build import build_corpus

    build_corpus(micro_config(tmp_path).data)  # the corpus, before the workers read it
    losses = run_ranks(_other_tokenizer_file_worker, 2, tmp_path / "w", str(tmp_path), timeout=100)
    assert losses[0] == losses[1]
    assert (tmp_path / "same-ids" / "summary.json").exists()


def test_bad_parallel_mode_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match=r"train\.parallel .*'pipeline'"):
        micro_config(tmp_path, "train.parallel=pipeline")
    with pytest.raises(ValueError, match=r"train\.parallel .*optim\.method='lora'"):
        micro_config(tmp_path, "optim.method=lora", "train.parallel=ddp")
    # the optimizer refuses it too, but after every rank built its data and model, and not by its flag
    with pytest.raises(ValueError, match=r"optim\.state_dtype must be .*train\.parallel='fsdp2'.*got 'int8'"):
        micro_config(tmp_path, "optim.state_dtype=int8", "train.parallel=fsdp2")
    micro_config(tmp_path, "optim.state_dtype=int8", "train.parallel=ddp")  # DDP steps plain tensors


def test_parallel_without_torchrun_or_with_world_size_and_none_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        train(micro_config(tmp_path, "train.parallel=ddp", "train.device=cpu"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--parallel ddp or --parallel fsdp2"):
        train(micro_config(tmp_path, out="other"))


def test_cuda_asked_of_a_launch_without_cuda_is_said_once(tmp_path, monkeypatch):
    """`torchrun --nproc_per_node 2 ... --parallel ddp train.device=cuda` on a machine without
    CUDA: every process printed "train.device='cuda' but CUDA is not available", each the same
    refusal of the config on the same machine; rank 0 says it for all."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="train.device='cuda' but CUDA is not available") as caught:
        train(micro_config(tmp_path, "train.parallel=ddp", "train.device=cuda"))
    assert getattr(caught.value, SAME_ON_EVERY_RANK, False)


@pytest.mark.parametrize("command", [
    ["pretrain", "--recipe", "micro", "--method", "fira"],
    ["compare", "--recipe", "micro", "--methods", "fira,adamw"],
])
def test_parallel_flag_sets_train_parallel(command):
    parser = build_parser()
    assert config_from_args(parser.parse_args(command)).train.parallel == "none"
    for mode in ("none", "ddp", "fsdp2"):
        args = parser.parse_args([*command, "--parallel", mode])
        assert config_from_args(args).train.parallel == mode
    args = parser.parse_args([*command, "train.parallel=fsdp2"])
    assert config_from_args(args).train.parallel == "fsdp2"
    args = parser.parse_args([*command, "--parallel", "ddp", "train.parallel=fsdp2"])
    with pytest.raises(ValueError, match="train.parallel is given twice, by --parallel ddp"):
        config_from_args(args)  # as for every flag: which one won would depend on nothing written
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--parallel", "tp"])


def _hung_peer_worker(rank: int, world: int, root: str) -> dict:
    """Leaves the test's group and joins one through ``distributed_session`` as a torchrun launch
    does (env://, here a rendezvous file), with ``train.dist_timeout_s=2``. Rank 1 stops itself
    (SIGSTOP: hung, not dead) before the DDP backward; rank 0's backward waits for it, then rank 0
    lets it go on (SIGCONT)."""
    import argparse
    import functools
    import os
    import signal
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fira_train.run.train_parallel import distributed_session
    from fira_train.user_errors import describe

    config = micro_config(Path(root), "train.parallel=ddp", "train.device=cpu", "train.dist_timeout_s=2")
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    join = dist.init_process_group
    dist.init_process_group = functools.partial(join, init_method=f"file://{root}/store-hung")
    try:
        with distributed_session(config):
            model = DistributedDataParallel(torch.nn.Linear(4, 4))
            pids = [None] * world
            dist.all_gather_object(pids, os.getpid())
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
                try:  # rank 0 gave up on this rank: its group is gone
                    dist.barrier()
                except RuntimeError:
                    pass
                return {}
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pids[1]}/stat").read_text().split(")")[-1].split()[0] != "T":
                assert time.monotonic() < deadline, "rank 1 did not stop"
                time.sleep(0.05)
            started = time.monotonic()
            try:
                model(torch.ones(2, 4)).sum().backward()  # DDP all-reduces the gradient
            except RuntimeError as err:
                waited = time.monotonic() - started
                line = describe(err, argparse.Namespace(command="pretrain", out="runs/x"))
                return {"error": str(err), "waited": waited, "line": line}
            finally:
                os.kill(pids[1], signal.SIGCONT)
            return {"error": None}
    finally:
        dist.init_process_group = join


@pytest.mark.timeout(120)
def test_a_hung_peer_is_an_error_after_train_dist_timeout_s(tmp_path):
    """A process stopped with kill -STOP left the others of a --parallel launch waiting silently
    for torch's default timeout (30 minutes on gloo); with train.dist_timeout_s=2 the collective
    fails after 2 s, and the command's one line names the setting and the time it waited."""
    outcome = run_ranks(_hung_peer_worker, 2, tmp_path / "w-hung", str(tmp_path), timeout=100)[0]
    assert outcome["error"] is not None and "Timed out waiting 2000ms" in outcome["error"], outcome
    assert 1.5 < outcome["waited"] < 20, outcome
    assert outcome["line"].startswith("a collective of this torchrun launch waited 2 s (train.dist_timeout_s) "
                                      "for another process that did not answer"), outcome["line"]
    assert "raise train.dist_timeout_s" in outcome["line"] and "with --resume" in outcome["line"]


def test_train_dist_timeout_s_is_checked_and_may_change_on_resume(tmp_path):
    from fira_train.run.run_dir import resume_ignores

    assert micro_config(tmp_path).train.dist_timeout_s == 0  # torch's default timeout
    assert micro_config(tmp_path, "train.dist_timeout_s=60").train.dist_timeout_s == 60
    for value in ("-1", "0.5", "inf", "nan", "1e10"):
        with pytest.raises(ValueError, match=r"^train.dist_timeout_s must be 0 \(torch's default\) or a number of "
                                             r"seconds in \[1, 1e\+09\], got "):
            micro_config(tmp_path, f"train.dist_timeout_s={value}")
    assert "train.dist_timeout_s" in resume_ignores(micro_config(tmp_path))
