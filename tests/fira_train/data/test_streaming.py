"""C4: streamed through datasets, tested on local files in C4's layout and format."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fira_train.data import tokenizer as tok
from fira_train.data.build import build_corpus
from fira_train.data.streaming import StreamingBatchStream, StreamingCorpus, build_c4_corpus
from fira_train.data.streams import BatchStream
from fira_train.run.state import check_corpus, corpus_record
from tests.fira_train.data.data_fixtures import make_docs, spec_for, take, write_jsonl


def write_c4_folder(folder: Path, train_docs: list[str], val_docs: list[str]) -> Path:
    """C4's layout: JSON lines {"text", "timestamp", "url"} in c4-<split>.NNNNN-of-NNNNN.json[.gz]."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(train_docs) // 2
    meta = {"timestamp": "2019-04-25T12:57:54Z", "url": "https://example.org/page"}
    write_jsonl(folder / "c4-train.00000-of-00002.json", train_docs[:half], **meta)
    write_jsonl(folder / "c4-train.00001-of-00002.json.gz", train_docs[half:], **meta)
    write_jsonl(folder / "c4-validation.00000-of-00001.json.gz", val_docs, **meta)
    return folder


@pytest.fixture(scope="module")
def c4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("c4")
    docs = make_docs(50, seed=7)
    return write_c4_folder(root / "en", docs[:40] + ["   "], docs[40:])  # a blank record is skipped


@pytest.fixture(scope="module")
def c4_corpus(c4_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    return build_corpus(spec_for(f"c4:{c4_folder}", tmp_path_factory.mktemp("cache"), val_sequences=3))


def test_c4_files_go_through_the_streaming_corpus(c4_corpus, c4_folder: Path) -> None:
    assert isinstance(c4_corpus, StreamingCorpus)
    stream = c4_corpus.train_batches(2, seed=0)
    assert isinstance(stream, StreamingBatchStream)
    batch = next(stream)
    assert batch.shape == (2, 16) and batch.dtype == torch.long
    info = c4_corpus.describe()
    assert info["train_tokens"] is None and info["val_tokens"] == 3 * 16 and info["source"] == f"c4:{c4_folder}"
    # Validation: the first documents of the validation split, packed with EOS.
    val_docs = make_docs(50, seed=7)[40:]
    expected = tok.encode_documents(c4_corpus.tokenizer, val_docs)[: 3 * 16]
    assert torch.equal(torch.cat(c4_corpus.val_batches(2)).flatten(), torch.from_numpy(expected.astype(np.int64)))
    # Test: the whole validation-split documents after the one the validation set ends in.
    encoded = [len(tok.encode_documents(c4_corpus.tokenizer, [d])) for d in val_docs]
    first_test = next(i for i in range(len(encoded)) if sum(encoded[:i]) >= 3 * 16)
    expected_test = tok.encode_documents(c4_corpus.tokenizer, val_docs[first_test:])[: 3 * 16]
    assert info["test_tokens"] == 3 * 16  # test_sequences None: as many as validation
    assert torch.equal(torch.cat(c4_corpus.test_batches(2)).flatten(),
                       torch.from_numpy(expected_test.astype(np.int64)))


def test_c4_second_build_reuses_the_tokenizer(c4_folder: Path, tmp_path: Path, monkeypatch) -> None:
    cold = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3))

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm build must not train the tokenizer again")

    monkeypatch.setattr(tok, "train_bpe", forbidden)
    warm = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3))
    assert warm.describe() == cold.describe()
    assert torch.equal(next(warm.train_batches(2, seed=0)), next(cold.train_batches(2, seed=0)))


def test_c4_stream_packs_documents_in_stream_order(c4_folder: Path, tmp_path: Path) -> None:
    spec = spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3)
    corpus = build_c4_corpus(spec, tmp_path, shuffle_buffer=1)  # no shuffling: file order
    train_docs = make_docs(50, seed=7)[:40]
    expected = tok.encode_documents(corpus.tokenizer, train_docs)
    n_batches = len(expected) // (4 * 16)
    got = torch.cat([b.flatten() for b in take(corpus.train_batches(4, seed=0), n_batches)])
    assert torch.equal(got, torch.from_numpy(expected[: n_batches * 64].astype(np.int64)))


def first_batch_of_each_epoch(stream: BatchStream, n: int) -> list[int]:
    """Indices (among the first ``n`` batches) at which a new epoch starts."""
    starts, epoch = [0], 0
    for i in range(n):
        next(stream)
        if stream.state_dict()["epoch"] != epoch:
            epoch = stream.state_dict()["epoch"]
            starts.append(i)
    return starts


def test_c4_stream_is_deterministic_and_reshuffles_each_epoch(c4_corpus) -> None:
    starts = first_batch_of_each_epoch(c4_corpus.train_batches(8, seed=0), 60)
    assert len(starts) >= 3, starts  # the test crosses two epoch boundaries
    first = take(c4_corpus.train_batches(8, seed=0), 60)
    again = take(c4_corpus.train_batches(8, seed=0), 60)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = take(c4_corpus.train_batches(8, seed=1), 60)
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    # Each epoch reshuffles: epoch 1 does not repeat epoch 0.
    epoch0, epoch1 = torch.cat(first[: starts[1]]), torch.cat(first[starts[1] : starts[2]])
    assert not torch.equal(epoch0[: len(epoch1)], epoch1[: len(epoch0)])


def test_c4_stream_seeds_do_not_share_epoch_orders_and_a_state_without_its_rule_keeps_the_former(c4_corpus) -> None:
    starts = first_batch_of_each_epoch(c4_corpus.train_batches(8, seed=0), 60)
    epoch1_seed0 = torch.cat(take(c4_corpus.train_batches(8, seed=0), starts[2])[starts[1]:])
    epoch0_seed1 = torch.cat(take(c4_corpus.train_batches(8, seed=1), starts[2] - starts[1]))
    # under the former rule (seed + epoch) these were the same batches
    assert not torch.equal(epoch1_seed0, epoch0_seed1)
    old = c4_corpus.train_batches(8, seed=0)
    state = old.state_dict()
    assert state["order"] == 2
    old.load_state_dict({k: v for k, v in state.items() if k != "order"})  # saved before the rule
    legacy = take(old, starts[2])  # every epoch holds as many batches (the same tokens, reordered)
    assert old.state_dict()["order"] == 1
    assert torch.equal(torch.cat(legacy[: starts[1]]), torch.cat(take(c4_corpus.train_batches(8, seed=0), starts[1])))
    assert torch.equal(torch.cat(legacy[starts[1] :]), epoch0_seed1)  # rule 1: seed 1's epoch 0


def test_c4_stream_resumes_exactly(c4_corpus) -> None:
    starts = first_batch_of_each_epoch(c4_corpus.train_batches(8, seed=4), 60)
    total = starts[2] + 3
    straight = take(c4_corpus.train_batches(8, seed=4), total)
    for resume_after in (0, 1, 5, starts[1] - 1, starts[1], starts[1] + 2, starts[2] + 1):
        stream = c4_corpus.train_batches(8, seed=4)
        take(stream, resume_after)
        state = stream.state_dict()
        assert all(type(v) is int for v in state.values())
        resumed = c4_corpus.train_batches(8, seed=4)
        resumed.load_state_dict(dict(state))
        for expected, got in zip(straight[resume_after:], take(resumed, total - resume_after)):
            assert torch.equal(expected, got), f"resumed after {resume_after} batches"


@pytest.mark.parametrize(("cut", "size"), [(8, 4), (4, 20)])
def test_a_c4_stream_state_of_another_batch_size_is_continued_row_for_row(c4_corpus, cut: int, size: int) -> None:
    """A run resumed with another micro-batch size: the same rows in the same order, across the
    epochs' ends as the saved size cut them (a batch of 8 runs on into the next epoch where the
    saved epoch's 4-row batches are not a multiple of 5); it was refused."""
    starts = first_batch_of_each_epoch(c4_corpus.train_batches(cut, seed=4), 60 * 8 // cut)
    step = math.lcm(cut, size)  # a global batch both divide
    assert size < cut or starts[1] % (step // cut)  # a batch of 20 runs on into the next epoch
    saved = c4_corpus.train_batches(cut, seed=4)
    take(saved, step // cut)
    state = saved.state_dict()
    batches = (starts[2] * cut // step + 1) * step // cut  # on across two epochs' ends
    expected = torch.cat(take(saved, batches - step // cut))
    resumed = c4_corpus.train_batches(size, seed=4)
    resumed.load_state_dict(dict(state))
    got = take(resumed, len(expected) // size)
    assert all(batch.shape[0] == size for batch in got)
    assert torch.equal(torch.cat(got), expected)
    assert resumed.state_dict() == saved.state_dict()
    if size < cut:
        next(resumed)
        with pytest.raises(ValueError, match=f"{size} rows into one"):
            resumed.state_dict()


def test_c4_stream_resume_mid_document_and_state_checks(c4_corpus) -> None:
    stream = c4_corpus.train_batches(1, seed=2)
    take(stream, 1)
    state = stream.state_dict()
    assert state["offset"] > 0 or state["documents"] > 0
    with pytest.raises(ValueError, match="seed"):
        c4_corpus.train_batches(1, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="'documents'"):
        c4_corpus.train_batches(1, seed=2).load_state_dict({**state, "documents": -2})
    beyond = c4_corpus.train_batches(1, seed=2)
    beyond.load_state_dict({**state, "documents": 10_000})
    with pytest.raises(ValueError, match="cannot resume"):
        next(beyond)


def test_a_checkpoint_of_a_c4_stream_tells_a_changed_folder_from_its_own(tmp_path: Path) -> None:
    """A resume on a C4 folder whose files changed was not checked (a stream recorded no fingerprint)."""
    docs = make_docs(50, seed=7)
    folder = write_c4_folder(tmp_path / "en", docs[:40], docs[40:])
    spec = spec_for(f"c4:{folder}", tmp_path / "cache", val_sequences=3)
    stream = build_corpus(spec).train_batches(2, seed=0)
    record = corpus_record(stream)
    assert set(record) == {"corpus"}
    check_corpus(record, build_corpus(spec).train_batches(2, seed=0), spec.source)  # the same files: resumes
    for path in folder.iterdir():  # copied to another machine without their times: still the same data
        os.utime(path, ns=(1, 1))
    check_corpus(record, build_corpus(spec).train_batches(2, seed=0), spec.source)
    assert build_corpus(replace(spec, max_train_tokens=200)).identity != stream.corpus  # another packing
    write_c4_folder(folder, docs[:40] + ["one more training document"], docs[40:])
    with pytest.raises(ValueError, match="trained on other data than data.source="):
        check_corpus(record, build_corpus(spec).train_batches(2, seed=0), spec.source)


def test_c4_max_train_tokens_ends_the_epoch(c4_folder: Path, tmp_path: Path) -> None:
    corpus = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3, max_train_tokens=200))
    stream = corpus.train_batches(2, seed=0)  # 32 tokens a batch: 6 batches fit in 200 tokens
    take(stream, 6)
    assert stream.state_dict()["epoch"] == 0
    next(stream)
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["tokens"] == 32
    too_big = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3, max_train_tokens=20))
    with pytest.raises(ValueError, match=r"train\.batch_size \* data\.seq_len = 2 \* 16 = 32 tokens "
                                         r"\(data\.max_train_tokens=20\)"):
        next(too_big.train_batches(2, seed=0))


def test_c4_hub_source_streams_allenai_c4_en(c4_folder: Path, tmp_path: Path, monkeypatch) -> None:
    """source='c4' asks datasets for allenai/c4 'en' in streaming mode (served here from local files)."""
    import datasets

    real_load = datasets.load_dataset
    calls = []

    def fake_load(path, name=None, *, split, streaming, **kwargs):
        calls.append((path, name, split, streaming))
        files = sorted(str(p) for p in c4_folder.glob(f"c4-{split}.*"))
        return real_load("json", data_files={split: files}, split=split, streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    corpus = build_corpus(spec_for("c4", tmp_path, val_sequences=3))
    assert next(corpus.train_batches(2, seed=0)).shape == (2, 16)
    assert {c[0] for c in calls} == {"allenai/c4"} and {c[1] for c in calls} == {"en"}
    assert {c[2] for c in calls} == {"train", "validation"} and all(c[3] for c in calls)


def test_c4_folder_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_corpus(spec_for(f"c4:{tmp_path / 'nowhere'}", tmp_path))
    folder = tmp_path / "trainonly"
    folder.mkdir()
    write_jsonl(folder / "c4-train.00000-of-00001.json", make_docs(5))
    with pytest.raises(ValueError, match=r"trainonly.*c4-validation"):
        build_corpus(spec_for(f"c4:{folder}", tmp_path))
    # the repository's root: one folder per variant, which a recursive search mixed
    root = tmp_path / "c4-repo"
    for variant in ("en", "realnewslike"):
        (root / variant).mkdir(parents=True)
        for split in ("train", "validation"):
            write_jsonl(root / variant / f"c4-{split}.00000-of-00001.json", make_docs(5))
    with pytest.raises(ValueError, match=r"its subfolders en, realnewslike hold some: give one variant's folder, "
                                         r"e.g. 'c4:.*c4-repo/en'"):
        build_corpus(spec_for(f"c4:{root}", tmp_path))
    # an empty shard: datasets' bare StopIteration was a traceback
    (root / "en" / "c4-train.00000-of-00001.json").write_text("")
    with pytest.raises(ValueError, match=r"C4 train files .*c4-train.00000-of-00001.json' cannot be read: "
                                         r"StopIteration: no records \(an empty file\?\)"):
        build_corpus(spec_for(f"c4:{root / 'en'}", tmp_path))
    # a damaged record in a shard, found while reading it: the files are named
    lines = [json.dumps({"text": f"document number {i} " * 20}) for i in range(60)]
    lines[40] = '{"text": "cut'
    (root / "en" / "c4-train.00000-of-00001.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"C4 train split \(files .*en/c4-train.00000-of-00001.json'\): reading the "
                                         r"record after \d+ good ones failed \(a damaged file\?\)"):
        build_corpus(spec_for(f"c4:{root / 'en'}", tmp_path))


def test_c4_short_validation_split_is_a_clear_error(c4_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_sequences"):
        build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=1000))
    with pytest.raises(ValueError, match="test set.*test_sequences"):
        build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3, test_sequences=1000))


@pytest.mark.parametrize("record", ['{"txt": "a typo in the key"}', '{"text": null}'])
def test_a_c4_record_without_text_names_the_files(tmp_path: Path, record: str) -> None:
    """A record of a local shard without a string "text" said "C4 train split: record 40 has no
    string 'text' field", naming no file of the hundreds a split may hold (a damaged record named
    them), nor what the record held."""
    folder = write_c4_folder(tmp_path / "en", make_docs(60), make_docs(20, seed=1))
    shard = folder / "c4-train.00000-of-00002.json"
    lines = shard.read_text().splitlines()
    lines[10] = record
    shard.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"C4 train split \(files .*c4-train.00000-of-00002.json'.*\): record 10 "
                                         r"\(counted from 0 in the order read\) has no string 'text' field \(got None\)"):
        build_corpus(spec_for(f"c4:{folder}", tmp_path / "cache"))
