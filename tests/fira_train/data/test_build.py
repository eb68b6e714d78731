"""build_corpus: document split, packing, packed batch streams and their resume, the token cache, pre-tokenized input."""

from __future__ import annotations

import errno
import io
import json
import math
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from fira_train.data import build
from fira_train.data import tokenizer as tok
from fira_train.data.build import ENCODING, build_corpus
from fira_train.files import file_digest
from tests.fira_train.data.data_fixtures import make_docs, read_only, spec_for, split_on_eos, take, write_jsonl


def test_split_is_fixed_disjoint_and_content_based() -> None:
    docs = make_docs(100)
    train, val, test = build.split_documents(docs, 0.1)
    assert len(val) == 10 and test == [] and sorted(train + val) == list(range(100))
    assert build.split_documents(docs, 0.1) == (train, val, [])
    # Content decides, not position: reversing the corpus selects the same texts.
    _, rev_val, _ = build.split_documents(docs[::-1], 0.1)
    assert {docs[::-1][i] for i in rev_val} == {docs[i] for i in val}


def test_test_split_is_disjoint_and_leaves_validation_as_it_was() -> None:
    docs = make_docs(100)
    train, val, test = build.split_documents(docs, 0.1, 0.05)
    assert len(val) == 10 and len(test) == 5
    assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
    assert sorted(train + val + test) == list(range(100))
    assert val == build.split_documents(docs, 0.1)[1]  # the test set takes the next-ranked documents
    _, _, rev_test = build.split_documents(docs[::-1], 0.1, 0.05)
    assert {docs[::-1][i] for i in rev_test} == {docs[i] for i in test}


def test_split_keeps_identical_texts_on_one_side() -> None:
    docs = make_docs(30) + ["repeated text"] * 5
    train, val, test = build.split_documents(docs, 0.3, 0.1)
    sides = {("val" if i in val else "test" if i in test else "train")
             for i, d in enumerate(docs) if d == "repeated text"}
    assert len(sides) == 1
    # the same text with surrounding whitespace (a .txt paragraph is stripped, JSON text is not):
    # one document, on one side (16 of 16 such validation documents had a twin in training)
    twins = make_docs(40)
    docs = twins + [f"{d}\n" for d in twins]
    train, val, test = build.split_documents(docs, 0.3, 0.1)
    side = {i: "val" if i in val else "test" if i in test else "train" for i in range(len(docs))}
    assert all(side[i] == side[i + len(twins)] for i in range(len(twins)))
    with pytest.raises(ValueError, match="at least 2 documents"):
        build.split_documents(["only one"], 0.5)
    with pytest.raises(ValueError, match="at least 3 documents"):
        build.split_documents(["one", "two"], 0.3, 0.3)
    with pytest.raises(ValueError, match="same text"):
        build.split_documents(["same", "same"], 0.5)
    with pytest.raises(ValueError, match="none remain for the test set"):
        build.split_documents(["same", "same", "same"], 0.3, 0.3)
    # distinct texts, taken by fractions that round up to whole documents: say so, with the values
    with pytest.raises(ValueError, match=r"validation \(val_fraction=0.5\) took 2 and test \(test_fraction=0.4\) 1: "
                                         r"each fraction rounds up"):
        build.split_documents(["one", "two", "three"], 0.5, 0.4)


def test_a_corpus_too_small_to_split_is_named_with_the_way_out(tmp_path: Path) -> None:
    (tmp_path / "two.txt").write_text("first paragraph\n\nsecond paragraph\n")
    with pytest.raises(ValueError, match=r"data source '.*two.txt': a split by document .* needs at least 3 "
                                         r"documents, got 2; data.test_fraction=0 holds out no test set"):
        build_corpus(spec_for(tmp_path / "two.txt", tmp_path / "cache", test_fraction=0.1))


def test_packing_joins_documents_with_eos_and_splits_by_document(jsonl_corpus, tmp_path: Path) -> None:
    path, docs = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    tokenizer = corpus.tokenizer
    train_idx, val_idx, test_idx = build.split_documents(docs, 0.2, 0.02)
    expected_train = tok.encode_documents(tokenizer, [docs[i] for i in train_idx])
    assert np.array_equal(np.asarray(corpus.train_tokens), expected_train)
    # Document boundaries are EOS; decoding the packed splits gives back the documents.
    train_docs = split_on_eos(np.asarray(corpus.train_tokens), tokenizer)
    assert train_docs == [docs[i] for i in train_idx]
    val_text = tokenizer.decode(torch.cat(corpus.val_batches(3)).flatten().tolist())
    val_markers = {d.split()[0] for d in val_text.split(tok.EOS_TOKEN) if d.strip()}
    assert val_markers and val_markers <= {docs[i].split()[0] for i in val_idx}
    assert not val_markers & {d.split()[0] for d in train_docs}
    # The test set: whole sequences of the held-out test documents, in neither other split.
    test_text = tokenizer.decode(torch.cat(corpus.test_batches(3)).flatten().tolist())
    test_markers = {d.split()[0] for d in test_text.split(tok.EOS_TOKEN) if d.strip()}
    assert test_markers and test_markers <= {docs[i].split()[0] for i in test_idx}
    assert not test_markers & ({d.split()[0] for d in train_docs} | val_markers)
    info = corpus.describe()
    assert info["source"] == str(path) and info["val_tokens"] == 4 * 16
    assert info["train_tokens"] == len(expected_train) // 16 * 16
    assert info["tokenizer"].startswith("bpe300-") and corpus.vocab_size == len(tokenizer) == 300


def test_batches_have_the_contract_shape_and_cover_an_epoch(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    stream = corpus.train_batches(batch_size=5, seed=0)
    blocks = np.asarray(corpus.train_tokens)[: len(corpus.train_tokens) // 16 * 16].reshape(-1, 16)
    epoch = take(stream, stream.batches_per_epoch)
    assert all(b.shape == (5, 16) and b.dtype == torch.long for b in epoch)
    rows = torch.cat(epoch).numpy()
    # Every row is a distinct block: an epoch is a permutation (minus the ragged tail).
    block_index = {blocks[i].tobytes(): i for i in range(len(blocks))}
    seen = [block_index[r.astype(blocks.dtype).tobytes()] for r in rows]
    assert len(set(seen)) == len(seen) == stream.batches_per_epoch * 5
    assert stream.state_dict()["epoch"] == 0
    next(stream)
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["index"] == 1


def test_streams_are_deterministic_and_seeded(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    first = take(build_corpus(spec).train_batches(4, seed=1), 20)
    again = take(build_corpus(spec).train_batches(4, seed=1), 20)  # second build: from the cache
    other = take(build_corpus(spec).train_batches(4, seed=2), 20)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_epochs_reshuffle_and_seeds_do_not_share_epoch_orders(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    stream = corpus.train_batches(2, seed=3)
    n = stream.batches_per_epoch
    epoch0, epoch1 = torch.cat(take(stream, n)), torch.cat(take(stream, n))
    assert not torch.equal(epoch0, epoch1)
    # Under the former rule (seed + epoch) epoch 1 of seed 3 was epoch 0 of seed 4.
    assert not torch.equal(epoch1, torch.cat(take(corpus.train_batches(2, seed=4), n)))
    # Epoch 0 is seeded by the seed itself, as before, so a run shorter than an epoch is unchanged.
    order = torch.randperm(len(stream._blocks), generator=torch.Generator().manual_seed(3))[: 2 * n]
    assert torch.equal(epoch0, torch.from_numpy(stream._blocks[order.numpy()].astype(np.int64)))


def test_a_stream_state_saved_without_its_order_rule_resumes_with_the_former_rule(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    state = corpus.train_batches(2, seed=3).state_dict()
    assert state["order"] == 2
    old = corpus.train_batches(2, seed=3)
    old.load_state_dict({k: v for k, v in state.items() if k != "order"})  # as saved before the rule
    n = old.batches_per_epoch
    take(old, n)
    assert old.state_dict()["order"] == 1  # saved again, it keeps its rule
    # seed + epoch: its epoch 1 is epoch 0 of seed 4, as in the run that saved the state
    assert torch.equal(torch.cat(take(old, n)), torch.cat(take(corpus.train_batches(2, seed=4), n)))
    for bad in (3, "2", True):
        with pytest.raises(ValueError, match=r"state\['order'\]"):
            corpus.train_batches(2, seed=3).load_state_dict({**state, "order": bad})
    # loaded into a stream that has drawn epoch 1's order already: the rule's own order is drawn
    busy = corpus.train_batches(2, seed=3)
    take(busy, n + 1)
    busy.load_state_dict({**{k: v for k, v in state.items() if k != "order"}, "epoch": 1, "index": 0})
    assert torch.equal(torch.cat(take(busy, n)), torch.cat(take(corpus.train_batches(2, seed=4), n)))


def test_data_epoch_order_1_reruns_the_former_order(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    former = build_corpus(spec_for(path, tmp_path / "cache", epoch_order=1))
    stream = former.train_batches(2, seed=3)
    n = stream.batches_per_epoch
    epoch0, epoch1 = take(stream, n), take(stream, n)
    assert stream.state_dict()["order"] == 1
    today = build_corpus(spec_for(path, tmp_path / "cache")).train_batches(2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(epoch0, take(today, n)))  # epoch 0: one rule
    assert not all(torch.equal(a, b) for a, b in zip(epoch1, take(today, n)))
    assert all(torch.equal(a, b) for a, b in zip(epoch1, take(former.train_batches(2, seed=4), n)))


def test_packed_stream_resumes_exactly(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    per_epoch = corpus.train_batches(16, seed=5).batches_per_epoch
    total = 2 * per_epoch + 3
    straight = take(corpus.train_batches(16, seed=5), total)
    # Start, mid-epoch, last batch of an epoch, first of the next, and inside the third epoch.
    for resume_after in (0, 1, per_epoch - 1, per_epoch, per_epoch + 3, 2 * per_epoch + 1):
        stream = corpus.train_batches(16, seed=5)
        take(stream, resume_after)
        state = stream.state_dict()
        assert all(type(v) is int for v in state.values())
        buffer = io.BytesIO()
        torch.save(state, buffer)  # as a checkpoint would, loaded back with weights_only
        buffer.seek(0)
        resumed = build_corpus(spec_for(path, tmp_path / "cache")).train_batches(16, seed=5)
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        for expected, got in zip(straight[resume_after:], take(resumed, total - resume_after)):
            assert torch.equal(expected, got), f"resumed after {resume_after} batches"


def test_packed_stream_refuses_a_mismatched_state(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    state = corpus.train_batches(3, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed"):
        corpus.train_batches(3, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        corpus.train_batches(3, seed=5).load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="'index'"):
        corpus.train_batches(3, seed=5).load_state_dict({**state, "index": -1})
    with pytest.raises(ValueError, match="batch_size"):
        corpus.train_batches(10_000, seed=0)
    with pytest.raises(ValueError, match="seed"):
        corpus.train_batches(3, seed=-1)


@pytest.mark.parametrize(("cut", "size"), [(4, 2), (2, 10)])
def test_a_state_of_another_batch_size_is_continued_block_for_block(jsonl_corpus, tmp_path: Path, cut: int,
                                                                    size: int) -> None:
    """A run resumed with another micro-batch size (the same global batch, which both divide):
    the same blocks in the same order, the epochs still cut in the saved size (a batch of 10 runs
    on into the next epoch, whose blocks of 2 it does not divide); it was refused."""
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    step = math.lcm(cut, size)  # a global batch both divide
    saved = corpus.train_batches(cut, seed=5)
    take(saved, step // cut)  # one step
    state = saved.state_dict()
    rows = saved.batches_per_epoch * cut
    blocks = (2 * rows // step + 1) * step  # on across an epoch's end
    assert size == 2 or rows % size  # a batch of 10 runs on into the next epoch
    expected = torch.cat(take(saved, blocks // cut))
    resumed = corpus.train_batches(size, seed=5)
    resumed.load_state_dict(state)
    got = take(resumed, blocks // size)
    assert all(batch.shape[0] == size for batch in got)
    assert torch.equal(torch.cat(got), expected)
    assert resumed.state_dict() == saved.state_dict()  # as the saved size keeps it
    if size < cut:  # partway through a batch of the saved size: no state to save there
        next(resumed)
        with pytest.raises(ValueError, match=f"{size} blocks into one"):
            resumed.state_dict()
    with pytest.raises(ValueError, match=r"state\['batch_size'\]=100000 exceeds the"):
        corpus.train_batches(4, seed=5).load_state_dict({**state, "batch_size": 100_000, "index": 0})


def test_a_stream_cut_in_whole_steps_serves_the_same_sequences_at_any_batch_size(jsonl_corpus, tmp_path: Path) -> None:
    """A run's micro-batch size does not change its data: the epochs are cut in its steps."""
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    whole = corpus.train_batches(12, seed=3)
    expected = torch.cat(take(whole, 3 * whole.batches_per_epoch))
    for micro in (1, 4, 6):
        stream = corpus.train_batches(micro, seed=3, cut=12)
        assert torch.equal(torch.cat(take(stream, len(expected) // micro)), expected), micro
        assert stream.state_dict() == whole.state_dict()


def test_validation_set_is_fixed_across_runs_and_batch_sizes(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    corpus = build_corpus(spec)
    by3 = corpus.val_batches(3)
    assert [b.shape[0] for b in by3] == [3, 1]
    assert all(b.shape[1] == 16 and b.dtype == torch.long for b in by3)
    by4 = build_corpus(spec).val_batches(4)
    assert torch.equal(torch.cat(by3), torch.cat(by4))
    # Training (any seed) does not change it.
    take(corpus.train_batches(2, seed=9), 5)
    assert torch.equal(torch.cat(corpus.val_batches(1)), torch.cat(by4))


def test_max_train_tokens_caps_the_training_prefix(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    full = build_corpus(spec_for(path, tmp_path / "cache"))
    capped = build_corpus(spec_for(path, tmp_path / "cache", max_train_tokens=100))
    assert len(capped.train_tokens) == 100 and capped.describe()["train_tokens"] == 96
    assert np.array_equal(np.asarray(capped.train_tokens), np.asarray(full.train_tokens)[:100])
    assert torch.equal(torch.cat(capped.val_batches(4)), torch.cat(full.val_batches(4)))
    # what the cap leaves too small says that the cap did it
    with pytest.raises(ValueError, match=r"exceeds the 6 training sequences .*\(capped by data.max_train_tokens=100\)"):
        capped.train_batches(8, seed=0)
    with pytest.raises(ValueError, match=r"holds 10 tokens \(capped by data.max_train_tokens=10\), fewer than seq_len"):
        build_corpus(spec_for(path, tmp_path / "cache", max_train_tokens=10))


def test_capped_build_tokenizes_only_the_prefix(jsonl_corpus, tmp_path: Path, monkeypatch) -> None:
    path, _ = jsonl_corpus
    monkeypatch.setattr(tok, "ENCODE_CHUNK_DOCS", 4)  # so a prefix is fewer chunks than the corpus
    encoded = []
    real_encode = tok.encode_texts
    monkeypatch.setattr(tok, "encode_texts", lambda t, texts: encoded.append(len(texts)) or real_encode(t, texts))
    capped = build_corpus(spec_for(path, tmp_path / "cache", max_train_tokens=100))
    assert sum(encoded) < 60  # training documents after the first 100 tokens were never encoded
    assert sorted(p.name.split("-")[-1] for p in (tmp_path / "cache" / "tokens").iterdir()) == ["first100"]
    full = build_corpus(spec_for(path, tmp_path / "cache"))
    assert np.array_equal(np.asarray(capped.train_tokens), np.asarray(full.train_tokens)[:100])
    assert len(capped.train_tokens) == 100


def test_short_validation_split_is_a_clear_error(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    with pytest.raises(ValueError, match="val_sequences"):
        build_corpus(spec_for(path, tmp_path / "cache", val_sequences=10_000))
    with pytest.raises(ValueError, match=r"1 \* 4096"):
        build_corpus(spec_for(path, tmp_path / "cache", seq_len=4096, val_sequences=1, val_fraction=0.9,
                              test_fraction=0.0))


def test_test_set_size_and_its_errors(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    cache = tmp_path / "cache"
    every = build_corpus(spec_for(path, cache, test_fraction=0.1))  # every whole sequence
    available = len(torch.cat(every.test_batches(64)))
    assert available >= 2 and every.describe()["test_tokens"] == available * 16
    two = build_corpus(spec_for(path, cache, test_fraction=0.1, test_sequences=2))
    assert [b.shape for b in two.test_batches(1)] == [(1, 16), (1, 16)]
    assert torch.equal(torch.cat(two.test_batches(2)), torch.cat(every.test_batches(5))[:2])
    with pytest.raises(ValueError, match="test_sequences"):
        build_corpus(spec_for(path, cache, test_fraction=0.1, test_sequences=available + 1))
    none = build_corpus(spec_for(path, cache, test_fraction=0.0))
    assert none.test_batches(4) == [] and none.describe()["test_tokens"] == 0



def test_cache_hit_is_identical_and_skips_all_work(jsonl_corpus, tmp_path: Path, monkeypatch) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    cold = build_corpus(spec)

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm build must not read, train or tokenize")

    monkeypatch.setattr(tok, "train_bpe", forbidden)
    monkeypatch.setattr(build, "iter_encoded_documents", forbidden)
    monkeypatch.setattr(build, "read_documents", forbidden)
    warm = build_corpus(spec)
    assert np.array_equal(np.asarray(warm.train_tokens), np.asarray(cold.train_tokens))
    assert torch.equal(torch.cat(warm.val_batches(4)), torch.cat(cold.val_batches(4)))
    assert warm.tokenizer.backend_tokenizer.to_str() == cold.tokenizer.backend_tokenizer.to_str()
    leftovers = [p for p in (tmp_path / "cache").rglob(".tmp*")]
    assert leftovers == []


def test_changed_corpus_is_a_new_cache_entry(tmp_path: Path) -> None:
    docs = make_docs(60)
    path = write_jsonl(tmp_path / "corpus.jsonl", docs)
    before = build_corpus(spec_for(path, tmp_path / "cache"))
    write_jsonl(path, docs[:-1] + ["Doc59 a changed last document about the river."])
    after = build_corpus(spec_for(path, tmp_path / "cache"))
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
    assert before.describe()["tokenizer"] != after.describe()["tokenizer"]


def test_damaged_token_cache_is_rebuilt(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    cold = np.asarray(build_corpus(spec).train_tokens).copy()
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    (entry / "train.npy").write_bytes((entry / "train.npy").read_bytes()[:100])  # truncated
    assert np.array_equal(np.asarray(build_corpus(spec).train_tokens), cold)
    # a meta.json nested too deeply for json.loads: RecursionError, a traceback, before
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    (entry / "meta.json").write_text("[" * 100_000)
    assert np.array_equal(np.asarray(build_corpus(spec).train_tokens), cold)
    # a meta.json larger than any record fira-train writes (sparse: no disk) is not read whole
    from fira_train.files import RECORD_LIMIT

    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    with open(entry / "meta.json", "wb") as handle:
        handle.truncate(RECORD_LIMIT + 1)
    assert np.array_equal(np.asarray(build_corpus(spec).train_tokens), cold)
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    assert (entry / "meta.json").stat().st_size < 10_000  # rebuilt


def _rewrite_tokens(path: Path, change) -> None:
    """Rewrite the token ids of a cached .npy in place (same header, same size)."""
    ids = np.load(path, allow_pickle=False)
    np.save(path, change(ids).astype(ids.dtype))


@pytest.mark.parametrize("damage", [
    lambda ids: ids[::-1],                   # in-range garbage: trained on silently before
    lambda ids: np.full_like(ids, np.iinfo(ids.dtype).max),  # out-of-range ids: an IndexError before
    None,                                    # an entry without digests (an older fira-train's)
])
def test_damaged_token_ids_are_detected_named_and_rebuilt(jsonl_corpus, tmp_path: Path, damage, caplog) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    cold = np.asarray(build_corpus(spec).train_tokens).copy()
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    if damage is None:
        meta = json.loads((entry / "meta.json").read_text())
        del meta["sha256"]
        (entry / "meta.json").write_text(json.dumps(meta))
    else:
        _rewrite_tokens(entry / "train.npy", damage)
    with caplog.at_level("WARNING"):
        rebuilt = np.asarray(build_corpus(spec).train_tokens)
    assert np.array_equal(rebuilt, cold)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert str(entry) in warning and "rebuilding it" in warning
    assert ("train.npy does not match" in warning) if damage is not None else ("no digests" in warning)
    meta = json.loads((entry / "meta.json").read_text())
    assert set(meta["sha256"]) == {"train.npy", "val.npy", "test.npy"}  # the rebuilt entry records them again


@pytest.fixture
def saved_tokenizer(tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    tok.train_bpe(make_docs(40), 300).save_pretrained(str(folder))
    return folder


def test_pretokenized_npy_is_packed_as_is(tmp_path: Path, saved_tokenizer: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 300, size=2000).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    corpus = build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))
    # val: the last 20% of tokens; test: the 2% (40 tokens, 2 whole sequences) before them
    assert np.array_equal(np.asarray(corpus.train_tokens), ids[:1560])
    assert torch.equal(torch.cat(corpus.val_batches(4)).flatten(), torch.from_numpy(ids[1600:1664]).long())
    assert torch.equal(torch.cat(corpus.test_batches(4)).flatten(), torch.from_numpy(ids[1560:1592]).long())
    assert next(corpus.train_batches(2, seed=0)).shape == (2, 16)
    # its identity follows the ids (a checkpoint refuses another array: it went on silently)
    assert corpus.identity and corpus.train_batches(2, seed=0).corpus == corpus.identity
    # its token digest is kept in the cache: a later start reads the ids for its identity and range only
    digest = corpus.token_digest
    assert [p.read_text().strip() for p in (tmp_path / "cache" / "token-digests").iterdir()] == [digest]
    np.save(tmp_path / "ids.npy", (ids * 7 + 1) % 300)
    other = build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))
    assert other.identity != corpus.identity and other.token_digest != digest
    # another split of the same file whose blocks have the same shapes: its own identity and digest
    moved = build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer),
                                  val_fraction=0.199))
    assert len(moved.train_tokens) // 16 == len(other.train_tokens) // 16
    assert not torch.equal(moved.val_batches(4)[0], other.val_batches(4)[0])
    assert moved.identity != other.identity and moved.token_digest != other.token_digest
    fresh = build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "fresh", tokenizer=str(saved_tokenizer),
                                  val_fraction=0.199))
    assert moved.token_digest == fresh.token_digest  # as computed without the cache
    # a test_fraction too small for one sequence (2 tokens): an error, not a silently empty test set
    with pytest.raises(ValueError, match=r"test_fraction=0.001\) holds 2 tokens, not one sequence of seq_len=16"):
        build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer),
                              test_fraction=0.001))


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [
        (np.array([1, 2, 300, 4] * 100), r"ids\.npy: token ids must lie in \[0, 300\).*max 300"),
        (np.array([1, -1, 2, 3] * 100), r"ids\.npy: token ids must lie.*min -1"),
        (np.ones((20, 20), dtype=np.int64), r"ids\.npy: token ids must be a 1-D integer array"),
        (np.ones(400, dtype=np.float32), r"ids\.npy: .*dtype float32"),
        (np.zeros(0, dtype=np.int64), r"ids\.npy: holds no token ids"),
    ],
)
def test_bad_token_ids_name_the_file(tmp_path: Path, saved_tokenizer: Path, ids: np.ndarray, pattern: str) -> None:
    np.save(tmp_path / "ids.npy", ids)
    with pytest.raises(ValueError, match=pattern):
        build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))


@pytest.mark.parametrize("dtype", ["<i4", ">u2", "<i8"])
def test_the_digest_and_range_of_token_ids_are_one_read_a_chunk_at_a_time(tmp_path: Path, monkeypatch,
                                                                          dtype: str) -> None:
    monkeypatch.setattr(build, "DIGEST_CHUNK", 7)  # chunks of 7 ids: the extremes in different chunks
    for values, expected in (([5, 3, 9, 4, 4, 4, 4, 4, 4, 4, 2, 4, 4, 4, 11, 4], (2, 11)), ([6], (6, 6))):
        path = tmp_path / "ids.npy"
        np.save(path, np.array(values, dtype=dtype))
        ids = np.load(path, mmap_mode="r")
        assert build._digest_and_range(path, ids) == (file_digest(path), *expected)
    with open(path, "ab") as f:
        f.write(b"tail")  # bytes after the array are part of the file's identity too
    assert build._digest_and_range(path, np.load(path, mmap_mode="r"))[0] == file_digest(path)


def test_pretokenized_needs_its_tokenizer(tmp_path: Path, saved_tokenizer: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(100))
    with pytest.raises(ValueError, match=r"ids\.npy.*tokenizer='bpe'"):
        build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache"))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=r"junk\.npy: not a readable \.npy"):
        build_corpus(spec_for(tmp_path / "junk.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))


def test_a_file_in_place_of_the_cache_folder_fails_before_the_tokenizer_is_trained(tmp_path, monkeypatch) -> None:
    """The cache folder is made first: a file in the way is an OSError naming it at once, not after
    minutes of tokenizer training for a cache the corpus cannot be written to."""
    source = write_jsonl(tmp_path / "docs.jsonl", make_docs(40))
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("not a folder")
    monkeypatch.setattr(build, "build_tokenizer", lambda *a, **k: pytest.fail("tokenizer trained"))
    with pytest.raises(OSError) as caught:
        build_corpus(spec_for(source, in_the_way))
    assert caught.value.filename == str(in_the_way)


def test_a_read_only_cache_without_the_tokens_is_refused_before_the_corpus_is_read(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Its tokenizer cached, its token ids not: refused before the corpus is read and tokenized,
    naming the folder and the setting; a cache that holds both is read, writable or not."""
    source = write_jsonl(tmp_path / "docs.jsonl", make_docs(40))
    spec = spec_for(source, tmp_path / "cache")
    built = build_corpus(spec).describe()
    shutil.rmtree(tmp_path / "cache" / "tokens")
    with monkeypatch.context() as patched:
        read_only(patched, tmp_path / "cache")
        patched.setattr(build, "read_documents", lambda *a: pytest.fail("the corpus was read"))
        with pytest.raises(OSError, match="data.cache_dir") as caught:
            build_corpus(spec)
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(tmp_path / "cache" / "tokens")
    build_corpus(spec)
    read_only(monkeypatch, tmp_path / "cache")
    assert build_corpus(spec).describe() == built


def test_a_token_cache_encoded_before_special_token_text_was_text_is_encoded_again(jsonl_corpus, tmp_path: Path,
                                                                                  caplog) -> None:
    """An entry without the "encoding" record (its documents' <|endoftext|> text may hold EOS ids)
    is built again, under the same key: a corpus without such text gets the same ids."""
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    corpus = build_corpus(spec)
    cold, identity = np.asarray(corpus.train_tokens).copy(), corpus.describe()["corpus"]
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta.pop("encoding") == ENCODING
    (entry / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level("INFO"):
        again = build_corpus(spec)
    assert str(entry) in caplog.text and "encoding it again" in caplog.text
    assert np.array_equal(np.asarray(again.train_tokens), cold) and again.describe()["corpus"] == identity
    assert json.loads((entry / "meta.json").read_text())["encoding"] == ENCODING


def test_a_token_cache_encoded_again_is_not_given_the_token_digest_kept_for_its_former_ids(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    """An entry encoded again under the same key (ENCODING: special-token text now text) has other
    ids; the token digest kept in token-digests/ was keyed by the key and the block shapes alone,
    which a capped corpus (or a count of ids in the same seq_len multiple) keeps, so the new ids
    were given the former digest, and a run resumed across the change (its checkpoint records
    that digest) went on, on other data, unchecked."""
    from fira_train.data.corpus import digest_ids
    from fira_train.run.state import check_corpus, corpus_record

    docs = [d + f" {tok.EOS_TOKEN} " + d if i % 2 == 0 else d for i, d in enumerate(make_docs(60, seed=3))]
    spec = spec_for(write_jsonl(tmp_path / "corpus.jsonl", docs), tmp_path / "cache", max_train_tokens=3000)
    encode = tok.encode_texts

    def as_special(tokenizer, texts):  # the encoding before: special-token text got the special ids
        tok.disable_truncation_and_padding(tokenizer)
        return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    monkeypatch.setattr(tok, "encode_texts", as_special)
    before = build_corpus(spec)
    record = corpus_record(before.train_batches(2, seed=0))  # what a checkpoint of that run holds
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    del meta["encoding"]  # as written before ENCODING
    (entry / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(tok, "encode_texts", encode)
    after = build_corpus(spec)
    assert len(after.train_tokens) == len(before.train_tokens)  # the same blocks: the kept digest's name
    assert not np.array_equal(np.asarray(after.train_tokens), np.asarray(before.train_tokens))
    used = len(after.train_tokens) // spec.seq_len * spec.seq_len
    assert after.token_digest == digest_ids(spec.seq_len, after.vocab_size, after.train_tokens[:used],
                                            after._val_blocks, after._test_blocks)
    with pytest.raises(ValueError, match="trained on other data"):
        check_corpus(record, after.train_batches(2, seed=0), spec.source)


def test_a_missing_source_close_to_a_corpus_name_suggests_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data source 'wikii' does not exist \(did you mean 'wiki'\?\)"):
        build_corpus(spec_for("wikii", tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match=r"does not exist$"):  # a path: no corpus name to suggest
        build_corpus(spec_for(str(tmp_path / "wiki"), tmp_path / "cache"))


def test_a_token_cache_that_cannot_be_written_whole_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """numpy writes an array with ``tofile``, whose short write (a full disk, a file-size limit) is
    an OSError without an errno: the user saw "error: 2304053 requested and 1032128 written", not
    that the cache was full, nor where. A real file-size limit (``ulimit -f``: EFBIG, as a full
    disk gives ENOSPC) in a child process."""
    path = write_jsonl(tmp_path / "corpus.jsonl", make_docs(3000))
    cache = tmp_path / "cache"
    code = (
        "import resource, sys\n"
        "from fira_train.data.build import build_corpus\n"
        "from fira_train.user_errors import describe\n"
        "from tests.fira_train.data.data_fixtures import spec_for\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    build_corpus(spec_for(sys.argv[1], sys.argv[2]))\n"
        "except OSError as err:\n"
        "    print(err.errno, err.filename, sep='\\n')\n"
        "    print(describe(err))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path), str(cache)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr
    number, filename, message = done.stdout.splitlines()[-3:]
    assert number == str(errno.EFBIG) and Path(filename).name == "train.npy", done.stdout
    assert Path(filename).is_relative_to(cache / "tokens") and "grew past the largest" in message
    assert not list((cache / "tokens").iterdir())  # no partial entry left behind


def test_a_cold_build_writes_its_ids_a_chunk_at_a_time_and_serves_them_from_the_cache(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A cold build joined each split's ids in memory before saving them, holding them twice at
    the join (180 MB of JSON lines, 117M ids: 1.07 GB peak RSS), and its run then trained from
    that copy in its own memory, where a warm build maps the cache file. Measured from the end
    of the document split (reading and splitting hold the text, as they must)."""
    path = write_jsonl(tmp_path / "corpus.jsonl", make_docs(40000))
    spec = spec_for(path, tmp_path / "cache")
    build_corpus(spec)
    shutil.rmtree(tmp_path / "cache" / "tokens")  # the tokenizer stays: a cold build of the ids only
    monkeypatch.setattr(tok, "ENCODE_CHUNK_DOCS", 64)
    split, held = build.split_documents, []

    def split_then_measure(*args, **kwargs):
        result = split(*args, **kwargs)
        tracemalloc.reset_peak()
        held.append(tracemalloc.get_traced_memory()[0])  # the documents, held until the build ends
        return result

    monkeypatch.setattr(build, "split_documents", split_then_measure)
    tracemalloc.start()
    try:
        cold = build_corpus(spec)
        peak = tracemalloc.get_traced_memory()[1] - held[0]
    finally:
        tracemalloc.stop()
    # a chunk of documents' ids and a digest's read buffer (1 MiB) at a time: it was 3x the ids
    assert peak < 0.75 * cold.train_tokens.nbytes, (peak, cold.train_tokens.nbytes)
    assert isinstance(cold.train_tokens, np.memmap)
    warm = build_corpus(spec)
    assert np.array_equal(cold.train_tokens, warm.train_tokens) and cold.token_digest == warm.token_digest


def test_a_cache_and_a_run_folder_inside_the_corpus_folder_are_not_read_as_corpus(tmp_path: Path) -> None:
    """A visible cache folder (data.cache_dir) inside the folder of corpus files: the second build
    listed its JSON files as documents (and failed on them); the run's output folder there too.
    Neither changes the corpus's identity: it is that of the folder without them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "docs.jsonl", make_docs(60))
    elsewhere = build_corpus(spec_for(corpus, tmp_path / "other-cache")).describe()
    spec = spec_for(corpus, corpus / "cache")
    first = build_corpus(spec).describe()
    assert list((corpus / "cache").rglob("*.json"))  # the cache holds JSON files the second time
    assert build_corpus(spec).describe() == first == elsewhere
    out = corpus / "runs" / "first"
    out.mkdir(parents=True)  # what a run writes there: JSON and JSON lines that are not documents
    (out / "config.json").write_text('{"data": {}}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert build_corpus(spec, exclude=(out,)).describe() == first


def test_a_cache_folder_that_is_the_corpus_folder_is_not_read_as_corpus(tmp_path: Path) -> None:
    """data.cache_dir (or $FIRA_CACHE) set to the folder of corpus files itself: the folder is read,
    the cache's entries in it are not (the second build listed the tokenizer's JSON files as
    documents and failed on them)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "docs.jsonl", make_docs(60))
    elsewhere = build_corpus(spec_for(corpus, tmp_path / "other-cache")).describe()
    spec = spec_for(corpus, corpus)
    first = build_corpus(spec).describe()
    assert list((corpus / "tokenizers").rglob("*.json"))
    assert build_corpus(spec).describe() == first == elsewhere
