"""The token digest and the comparison of two records of a run's data."""

from __future__ import annotations

import numpy as np
import pytest

from fira_train.data import corpus as corpus_module
from fira_train.data.corpus import data_change, digest_ids


def test_the_token_digest_depends_on_the_ids_not_on_how_they_are_stored(monkeypatch) -> None:
    ids = np.arange(1000) % 300
    val, test = np.arange(64).reshape(4, 16), np.zeros((0, 16), dtype=np.int64)
    digest = digest_ids(16, 300, ids.astype(np.uint16), val, test)
    assert digest == digest_ids(16, 300, ids.astype(np.int64), val.astype(np.int32), test)
    monkeypatch.setattr(corpus_module, "DIGEST_CHUNK", 7)  # chunks that cut parts anywhere
    assert digest_ids(16, 300, ids, val, test) == digest
    other = ids.copy()
    other[500] += 1
    assert digest_ids(16, 300, other, val, test) != digest
    # the same ids cut between the parts otherwise, or in other blocks, are other data
    assert digest_ids(16, 300, ids[:-16], np.concatenate([ids[-16:], val.reshape(-1)]), test) != digest
    assert digest_ids(32, 300, ids, val, test) != digest
    assert digest_ids(16, 301, ids, val, test) != digest  # another vocabulary: another embedding


def test_data_change_compares_the_most_exact_record_both_have() -> None:
    now = {"token_digest": "t1", "corpus": "c1", "tokenizer": "bpe", "train_tokens": 10}
    assert data_change(now, now) is None
    assert data_change({**now, "corpus": "c0"}, now) is None  # same ids from another tokenizer file
    assert data_change({**now, "token_digest": "t0"}, now) == (
        "its text, split or tokenizer changed since: token_digest='t0' (now 't1')")
    old = {"corpus": "c0", "tokenizer": "bpe", "train_tokens": 10}  # written before token digests
    assert "cannot tell" in data_change(old, now) and "corpus='c0' (now 'c1')" in data_change(old, now)
    oldest = {"tokenizer": "bpe", "train_tokens": 12}  # written before fingerprints
    assert data_change(oldest, now) == "its text, split or tokenizer changed since: train_tokens=12 (now 10)"
    renamed = data_change({"tokenizer": "bpe-v1", "train_tokens": 10}, now)  # only the name: cannot tell
    assert "cannot tell" in renamed and renamed.endswith("tokenizer='bpe-v1' (now 'bpe')")
    assert data_change({}, now) is None and data_change(now, {"token_digest": None, "corpus": None}) is None


@pytest.mark.parametrize("vocab", [300, 70000])
def test_a_packed_corpus_digests_the_ids_it_serves(tmp_path, vocab: int) -> None:
    from fira_train.data.corpus import PackedCorpus
    from fira_train.data.spec import DataSpec

    spec = DataSpec(source="x.txt", seq_len=8, val_sequences=2, test_sequences=1, max_train_tokens=64)
    ids = (np.arange(100) * 7) % vocab

    class Tok:  # the corpus reads len() only
        def __len__(self) -> int:
            return vocab

    corpus = PackedCorpus(spec, Tok(), "tok", ids, ids[:16], ids[16:24])  # type: ignore[arg-type]
    assert corpus.token_digest == digest_ids(8, vocab, ids[:64], ids[:16], ids[16:24])
    assert corpus.describe()["token_digest"] == corpus.token_digest
    assert corpus.train_batches(2, seed=0).token_digest == corpus.token_digest


def test_a_cached_corpus_reads_its_ids_for_the_digest_once(tmp_path, monkeypatch) -> None:
    """Every start read every training id a second time for the digest (after the cache's own
    check had read the files): seconds per start and rank on a large corpus."""
    from fira_train.data.build import build_corpus
    from tests.fira_train.data.data_fixtures import make_docs, spec_for, write_jsonl

    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", make_docs(40, seed=3))
    spec = spec_for(tmp_path / "corpus", tmp_path / "cache")
    calls = []
    real = corpus_module.digest_ids
    monkeypatch.setattr(corpus_module, "digest_ids", lambda *args: calls.append(1) or real(*args))
    first = build_corpus(spec).token_digest
    assert build_corpus(spec).token_digest == first and len(calls) == 1  # the second start reads it back
    other = build_corpus(spec_for(tmp_path / "corpus", tmp_path / "cache", seq_len=8)).token_digest
    assert other != first and len(calls) == 2  # other blocks: another digest
    kept = list((tmp_path / "cache" / "token-digests").iterdir())
    assert len(kept) == 2
    for path in kept:
        path.write_text(path.read_text()[:10])  # cut short by a kill: computed again
    assert build_corpus(spec).token_digest == first and len(calls) == 3
