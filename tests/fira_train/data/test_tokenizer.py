"""Tests of fira_train.data.tokenizer: byte-level BPE training, caching, loading and encoding."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import numpy as np
import pytest

from fira_train.data import tokenizer as tok
from tests.fira_train.data.data_fixtures import read_only

WORDS = (
    "the of and a to in is was for on that with as by at from his her an were are which this be "
    "river mountain empire language science music planet animal war city king queen theory"
).split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Article {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 40))) + "." for i in range(n)]


@pytest.fixture(scope="module")
def bpe():
    return tok.train_bpe(make_texts(200), 300)


def test_bpe_vocabulary_and_special_tokens(bpe) -> None:
    assert len(bpe) == 300  # 256 bytes + 2 specials + 42 merges: the corpus admits far more merges
    assert bpe.eos_token == tok.EOS_TOKEN and bpe.pad_token == tok.PAD_TOKEN
    assert {bpe.eos_token_id, bpe.pad_token_id} == {0, 1}  # special tokens come first
    assert bpe.bos_token_id == bpe.eos_token_id
    # Learned merges shorten frequent words: fewer tokens than UTF-8 bytes.
    text = "the river and the mountain"
    assert len(bpe(text, add_special_tokens=False)["input_ids"]) < len(text.encode())


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnew\n\nlines", "Café – naïve 東京 🙂", ""],
)
def test_bpe_round_trips_any_text(bpe, text: str) -> None:
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < len(bpe) for i in ids)
    assert bpe.decode(ids) == text  # byte-level: nothing is unknown, nothing is normalised away


def test_bpe_tiny_corpus_gives_smaller_vocabulary() -> None:
    small = tok.train_bpe(["ab ab ab"], 5000)
    assert tok.MIN_BPE_VOCAB_SIZE <= len(small) < 5000


def test_bpe_training_is_deterministic(bpe) -> None:
    again = tok.train_bpe(make_texts(200), 300)
    assert again.backend_tokenizer.to_str() == bpe.backend_tokenizer.to_str()


@pytest.mark.parametrize("vocab_size", [257, 0, -5, True, 300.0, "300"])
def test_bpe_rejects_bad_vocab_size(vocab_size: object) -> None:
    with pytest.raises(ValueError, match="vocab_size") as info:
        tok.train_bpe(["some text"], vocab_size)  # type: ignore[arg-type]
    assert repr(vocab_size) in str(info.value)


def test_bpe_cache_hit_skips_training_and_is_identical(tmp_path: Path) -> None:
    calls = []

    def texts() -> list[str]:
        calls.append(1)
        return make_texts(100)

    first, key = tok.load_or_train_bpe("corpus-a", texts, 300, tmp_path)
    second, key2 = tok.load_or_train_bpe("corpus-a", texts, 300, tmp_path)
    assert calls == [1] and key == key2
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert (second.eos_token_id, second.pad_token_id) == (first.eos_token_id, first.pad_token_id)
    assert (tmp_path / "tokenizers" / key / "tokenizer.json").is_file()
    assert not [p for p in (tmp_path / "tokenizers").iterdir() if p.name.startswith(".tmp")]
    # Another corpus, or another vocabulary size, is another entry.
    assert tok.bpe_cache_key("corpus-b", 300) != key
    assert tok.bpe_cache_key("corpus-a", 301) != key


@pytest.mark.parametrize("damage", ["{ not json", "{}", '{"model": {"type": "Bogus"}}'],
                         ids=["not-json", "empty-object", "unknown-model"])
def test_bpe_damaged_cache_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    """Valid JSON that is no tokenizer raised KeyError or the tokenizers library's bare Exception."""
    first, key = tok.load_or_train_bpe("c", lambda: make_texts(50), 300, tmp_path)
    (tmp_path / "tokenizers" / key / "tokenizer.json").write_text(damage)
    again, _ = tok.load_or_train_bpe("c", lambda: make_texts(50), 300, tmp_path)
    assert again.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()


def test_a_read_only_cache_is_refused_before_the_corpus_is_read_and_the_tokenizer_trained(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """It was refused as the trained tokenizer was saved: minutes of training lost."""
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    read_only(monkeypatch, cache)
    monkeypatch.setattr(tok, "train_bpe", lambda *a, **k: pytest.fail("the tokenizer was trained"))
    with pytest.raises(OSError) as caught:
        tok.load_or_train_bpe("c", lambda: pytest.fail("the corpus was read"), 300, cache)
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(cache / "tokenizers")
    assert str(cache / "tokenizers") in str(caught.value) and "data.cache_dir" in str(caught.value)


def test_failed_training_leaves_no_cache_entry(tmp_path: Path) -> None:
    def broken() -> list[str]:
        raise RuntimeError("reading the corpus failed")

    with pytest.raises(RuntimeError):
        tok.load_or_train_bpe("c", broken, 300, tmp_path)
    assert not (tmp_path / "tokenizers").exists() or not any((tmp_path / "tokenizers").iterdir())


def test_pretrained_tokenizer_from_local_folder(bpe, tmp_path: Path) -> None:
    bpe.save_pretrained(str(tmp_path / "tok"))
    loaded = tok.load_pretrained_tokenizer(str(tmp_path / "tok"))
    text = "the queen of the empire"
    assert loaded(text, add_special_tokens=False)["input_ids"] == bpe(text, add_special_tokens=False)["input_ids"]
    assert loaded.eos_token_id == bpe.eos_token_id and loaded.pad_token_id == bpe.pad_token_id
    built, name = tok.build_tokenizer(
        str(tmp_path / "tok"), vocab_size=8192, corpus_id="unused", training_texts=lambda: [], cache_dir=tmp_path
    )
    assert name == str(tmp_path / "tok") and len(built) == len(bpe)


def test_a_tokenizer_file_that_truncates_or_pads_encodes_documents_whole(bpe, tmp_path: Path) -> None:
    # some hub tokenizer.json files carry a truncation length or a padding strategy, which
    # transformers enables on the backend at load time; the corpus is encoded by the backend
    import json

    bpe.save_pretrained(str(tmp_path / "tok"))
    config = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    config["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    config["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": bpe.pad_token_id, "pad_type_id": 0, "pad_token": tok.PAD_TOKEN}
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(config))
    texts = ["the queen of the empire and the king of the river", "a war"]
    loaded = tok.load_pretrained_tokenizer(str(tmp_path / "tok"))
    assert tok.encode_documents(loaded, texts).tolist() == tok.encode_documents(bpe, texts).tolist()
    assert tok.tokenizer_fingerprint(loaded) == tok.tokenizer_fingerprint(bpe)  # the same cache entry
    # a tokenizer made elsewhere that truncates and pads on its backend is encoded whole too
    other = tok.wrap_bpe(bpe.backend_tokenizer.from_str(json.dumps(config)))
    assert other.backend_tokenizer.truncation is not None and other.backend_tokenizer.padding is not None
    truncation, padding = other.backend_tokenizer.truncation, other.backend_tokenizer.padding
    assert tok.encode_texts(other, texts) == tok.encode_texts(bpe, texts)
    # ... and is handed back as it came: its own truncation and padding are on again
    assert other.backend_tokenizer.truncation == truncation and other.backend_tokenizer.padding == padding
    assert len(other.backend_tokenizer.encode(texts[0]).ids) == 4


def test_pretrained_tokenizer_without_pad_pads_with_eos(bpe, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    no_pad = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, eos_token=tok.EOS_TOKEN)
    assert no_pad.pad_token_id is None
    no_pad.save_pretrained(str(tmp_path / "nopad"))
    loaded = tok.load_pretrained_tokenizer(str(tmp_path / "nopad"))
    assert loaded.pad_token_id == loaded.eos_token_id == bpe.eos_token_id


def test_pretrained_tokenizer_without_eos_or_sep_is_refused(bpe, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer).save_pretrained(str(tmp_path / "bare"))
    with pytest.raises(ValueError, match="bare.*EOS"):
        tok.load_pretrained_tokenizer(str(tmp_path / "bare"))


@pytest.mark.parametrize("name", ["missing-folder", "no/such/tokenizer/anywhere"])
def test_unloadable_tokenizer_names_it_and_suggests_bpe(tmp_path: Path, name: str) -> None:
    path = str(tmp_path / name)  # absolute and absent: fails without touching the network
    with pytest.raises(OSError) as info:
        tok.load_pretrained_tokenizer(path)
    assert path in str(info.value) and "data.tokenizer=bpe" in str(info.value)
    assert "--tokenizer" not in str(info.value)  # fira-train has no such flag: the override is the way


def test_a_tokenizer_file_instead_of_its_folder_is_named_a_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(OSError, match=r"tokenizer folder '.*tokenizer\.json' is a file, not a folder; pass the "
                                      r"folder holding tokenizer\.json"):
        tok.load_pretrained_tokenizer(str(path))


def test_invalid_hub_id_error_suggests_bpe() -> None:
    # Not a path and not a valid repo id: huggingface_hub rejects it before any request.
    with pytest.raises(OSError) as info:
        tok.load_pretrained_tokenizer("bad//repo id")
    assert "'bad//repo id'" in str(info.value) and "data.tokenizer=bpe" in str(info.value)


def test_encode_documents_appends_eos_after_every_document(bpe) -> None:
    texts = ["first document", "second one", "third"]
    stream = tok.encode_documents(bpe, texts)
    assert stream.dtype == np.uint16
    expected: list[int] = []
    for text in texts:
        expected += bpe(text, add_special_tokens=False)["input_ids"] + [bpe.eos_token_id]
    assert stream.tolist() == expected
    assert (stream == bpe.eos_token_id).sum() == len(texts)
    assert tok.encode_documents(bpe, []).shape == (0,)


def test_encode_documents_stops_at_max_tokens(bpe, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = make_texts(40, seed=2)
    whole = tok.encode_documents(bpe, texts)
    monkeypatch.setattr(tok, "ENCODE_CHUNK_DOCS", 5)
    calls = []
    real = tok.encode_texts
    monkeypatch.setattr(tok, "encode_texts", lambda t, chunk: calls.append(len(chunk)) or real(t, chunk))
    prefix = tok.encode_documents(bpe, texts, max_tokens=30)
    assert np.array_equal(prefix, whole[:30])
    assert sum(calls) < len(texts)  # later documents were not tokenized
    assert np.array_equal(tok.encode_documents(bpe, texts, max_tokens=10**9), whole)


def test_encode_documents_chunks_like_one_call(bpe, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = make_texts(23, seed=3)
    whole = tok.encode_documents(bpe, texts)
    monkeypatch.setattr(tok, "ENCODE_CHUNK_DOCS", 5)
    assert np.array_equal(tok.encode_documents(bpe, texts), whole)


def test_token_dtype_holds_every_id() -> None:
    assert tok.token_dtype(65_536) == np.uint16  # ids up to 65,535
    assert tok.token_dtype(65_537) == np.int32
    assert tok.token_dtype(300) == np.uint16


def test_fingerprint_tracks_the_vocabulary(bpe) -> None:
    other = tok.train_bpe(make_texts(200, seed=1), 300)
    assert tok.tokenizer_fingerprint(bpe) == tok.tokenizer_fingerprint(tok.train_bpe(make_texts(200), 300))
    assert tok.tokenizer_fingerprint(bpe) != tok.tokenizer_fingerprint(other)


def test_a_long_run_without_whitespace_is_cut_for_training_only() -> None:
    """One base64 blob or minified line stalled the BPE trainer (benchmarks/bpe_long_runs.py)."""
    assert tok._cut_long_runs("ab " + "x" * 600 + " cd") == "ab " + " ".join(["x" * 256, "x" * 256, "x" * 88]) + " cd"
    assert tok._cut_long_runs("x" * 256) == "x" * 256
    blob = "".join("abcdefghijklmnopqrstuvwxyz"[(i * 7) % 26] for i in range(20_000))
    tokenizer = tok.train_bpe([*make_texts(30), blob], 300)
    assert tokenizer.decode(tokenizer(blob)["input_ids"]) == blob  # encoded whole


def test_the_long_run_cut_changes_no_document_of_the_embedded_corpus() -> None:
    """What docs/results rely on: runs on the BPE tokenizer before the cut (another name, the
    recipe's version is in it) trained on the same tokenizer and the same ids as runs after it."""
    import pytest

    from fira_train.data.documents import read_wiki_documents, wiki_summaries_path
    from fira_train.data.tokenizer import _cut_long_runs

    try:
        path = wiki_summaries_path()
    except FileNotFoundError:
        pytest.skip("the wiki corpus package is not installed")
    documents = read_wiki_documents(path)
    assert len(documents) > 10_000
    assert all(_cut_long_runs(text) == text for text in documents)
    assert _cut_long_runs("x" * 600) != "x" * 600  # not vacuous: a long run is cut


def test_the_text_of_a_special_token_in_a_document_is_encoded_as_text(bpe) -> None:
    """A web page that writes <|endoftext|> got the EOS id in the middle of its document (a false
    document end), and <|pad|> the pad id; now both are ordinary text, as any other characters."""
    text = f"before {tok.EOS_TOKEN} middle {tok.PAD_TOKEN} after"
    (ids,) = tok.encode_texts(bpe, [text])
    assert bpe.eos_token_id not in ids and bpe.pad_token_id not in ids
    assert bpe.decode(ids) == text
    stream = tok.encode_documents(bpe, [text, "plain"])
    assert [i for i, x in enumerate(stream.tolist()) if x == bpe.eos_token_id] == [len(ids), len(stream) - 1]
    (plain,) = tok.encode_texts(bpe, ["the river and the mountain"])  # texts without them: as before
    assert plain == bpe("the river and the mountain", add_special_tokens=False)["input_ids"]
    assert bpe.backend_tokenizer.encode_special_tokens is False  # the tokenizer is left as it was


def test_a_cached_bpe_edited_since_it_was_written_is_trained_again(tmp_path: Path) -> None:
    """An edited or damaged tokenizer.json that still parses was used as it was: every later run
    got another vocabulary, silently. The entry records its files' SHA-256 when written."""
    import json

    first, key = tok.load_or_train_bpe("c", lambda: make_texts(50), 300, tmp_path)
    entry = tmp_path / "tokenizers" / key
    assert set(json.loads((entry / tok.TOKENIZER_DIGESTS).read_text())) == {
        p.name for p in entry.iterdir() if p.name != tok.TOKENIZER_DIGESTS}
    config = json.loads((entry / "tokenizer.json").read_text())
    merges = config["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # still a tokenizer, another one
    (entry / "tokenizer.json").write_text(json.dumps(config))
    calls = []
    again, _ = tok.load_or_train_bpe("c", lambda: calls.append(1) or make_texts(50), 300, tmp_path)
    assert calls == [1] and again.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    # a file added to the entry is not one it was written with either
    (entry / "added_tokens.json").write_text("{}")
    tok.load_or_train_bpe("c", lambda: calls.append(1) or make_texts(50), 300, tmp_path)
    assert calls == [1, 1]
    # a record larger than any fira-train writes (sparse: no disk) is not read whole: trained again
    from fira_train.files import RECORD_LIMIT

    with open(entry / tok.TOKENIZER_DIGESTS, "wb") as handle:
        handle.truncate(RECORD_LIMIT + 1)
    tok.load_or_train_bpe("c", lambda: calls.append(1) or make_texts(50), 300, tmp_path)
    assert calls == [1, 1, 1] and (entry / tok.TOKENIZER_DIGESTS).stat().st_size < 10_000
    # an entry written before the record existed is read as before (not trained again)
    (entry / tok.TOKENIZER_DIGESTS).unlink()
    old, _ = tok.load_or_train_bpe("c", lambda: calls.append(1) or make_texts(50), 300, tmp_path)
    assert calls == [1, 1, 1] and old.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
