"""Reading a DCP checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` unpickles ``.metadata`` with
plain :mod:`pickle`: a crafted file runs any code (``os.system``) the moment a checkpoint is
resumed. :func:`load_dcp_metadata` reads it with a restricted unpickler instead:

- globals: only the classes DCP's metadata is made of (``Metadata``, ``StorageMeta``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``_MEM_FORMAT_ENCODING``, the file reader's
  ``_StorageInfo``), ``torch.Size``, torch's dtypes, ``torch.serialization._get_layout`` (a
  lookup of ``torch.strided`` and the other layouts by name) and ``pathlib`` paths (the saved
  checkpoint id): found by disassembling (``pickletools``) the ``.metadata`` that torch 2.13's
  DCP writes for the harness's models and optimizers;
- calls (``REDUCE``): only ``torch.Size``, the path classes, ``_MEM_FORMAT_ENCODING`` and
  ``_get_layout``; instances (``NEWOBJ``): only the metadata classes, with no arguments;
  ``BUILD`` only on those instances, with their own field names;
- no ``INST`` / ``OBJ`` / ``NEWOBJ_EX``, extension codes or persistent ids.

Everything else raises :class:`UnsafeCheckpointError` naming the file and
the refused global or opcode. The result is then checked field by field (types, and every
shard file a plain name inside the checkpoint directory) before DCP sees it.

:class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` with ``read_metadata`` going through
:func:`load_dcp_metadata`: :mod:`fira_train.run.dist_checkpoint` loads only through it. Tensors and
other values in the shard files are read by ``torch.load(weights_only=True)`` (DCP's reader
for tensors, :mod:`fira_train.run.dist_checkpoint`'s planner for the rest).
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch

from fira_train.files import FileTooLargeError, read_regular_bytes
from fira_train.run.checkpoint import CheckpointError

METADATA_FILE = ".metadata"
#: The most bytes of a ``.metadata`` read (:func:`fira_train.files.read_regular_bytes`): it grows
#: with the number of tensors (weights and optimizer states) times the shards of each, a small
#: record apiece, so it is given far more room than the JSON records.
METADATA_LIMIT = 1 << 30


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that would create objects other than tensors and plain
    data (run code): it is refused, never loaded. Not a damaged file: resuming does not fall
    back to an older checkpoint past it."""


def unsafe_pickle_error(err: BaseException, path: str | Path) -> UnsafeCheckpointError | None:
    """The refusal to report for ``torch.load(path, weights_only=True)`` failing with ``err``,
    if it failed because the pickle asks for something ``weights_only`` does not allow; None
    for any other failure (a damaged file). One line: torch's own message suggests
    ``weights_only=False``, which is exactly what must not be done with such a file."""
    text = str(err)
    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in text:
        return None
    found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", text, re.IGNORECASE)
    what = f"a reference to {found.group(1)}" if found else "objects other than tensors and plain values"
    return UnsafeCheckpointError(
        f"refusing to load {str(path)!r}: it holds {what}, which fira-train never writes (a crafted "
        "or foreign file; fira-train does not run code from checkpoints)")


def _metadata_classes() -> dict[tuple[str, str], type]:
    from torch.distributed.checkpoint import filesystem, metadata

    names = ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
             "ChunkStorageMetadata", "TensorProperties", "MetadataIndex")
    classes = {(metadata.__name__, name): getattr(metadata, name) for name in names}
    classes[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    return classes


def _callables() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        (metadata.__name__, "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING,
    }
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 pickles paths from pathlib._local
        for name in ("Path", "PosixPath", "PurePosixPath", "PureWindowsPath"):
            allowed[(module, name)] = getattr(pathlib, name)
    return allowed


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be replaced
    """An unpickler that builds DCP metadata and nothing else (see the module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source
        self.classes = _metadata_classes()
        self.calls = _callables()
        self.buildable = tuple(self.classes.values())

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"refusing to load {self.source!r}: it holds {what}, which DCP checkpoint metadata never "
            "does (a crafted or foreign file; fira-train does not run code from checkpoints)")

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self.classes:
            return self.classes[key]
        if key in self.calls:
            return self.calls[key]
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # no lazy imports
            return vars(torch)[name]
        raise self.refuse(f"a reference to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise self.refuse("a persistent id")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is allowed for allowed in self.calls.values()) or not isinstance(args, tuple):
            raise self.refuse(f"a call of {getattr(func, '__qualname__', type(func).__name__)}")
        if not all(isinstance(a, (int, str, tuple)) for a in args):
            raise self.refuse(f"a call of {func.__qualname__} with arguments other than numbers and strings")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in self.buildable or args != ():
            raise self.refuse(f"an instance of {getattr(cls, '__qualname__', type(cls).__name__)}")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in self.buildable:
            raise self.refuse(f"a state for {type(inst).__qualname__}")
        if type(inst) is self.classes[("torch.distributed.checkpoint.metadata", "TensorProperties")]:
            _check_tensor_properties(state, self)
            inst.__setstate__(state)
            return
        fields = {f.name for f in dataclasses.fields(inst)}
        if not isinstance(state, dict) or not set(state) <= fields:
            raise self.refuse(f"a state for {type(inst).__qualname__} that is not a mapping of its fields")
        inst.__dict__.update({sys.intern(k): v for k, v in state.items()})

    def _refused_opcode(self) -> None:
        raise self.refuse("an opcode that creates arbitrary objects")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build
    for _code in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_code[0]] = _refused_opcode
    del _code


def _check_tensor_properties(state: Any, unpickler: _MetadataUnpickler) -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    ok = (isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], torch.dtype)
          and isinstance(state[1], torch.layout) and isinstance(state[2], bool)
          and isinstance(state[3], _MEM_FORMAT_ENCODING) and isinstance(state[4], bool))
    if not ok:
        raise unpickler.refuse("tensor properties that are not (dtype, layout, bool, format, bool)")


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size)


def _check_metadata(metadata: Any, source: str) -> None:
    """CheckpointError unless ``metadata`` has the shape DCP's ``Metadata`` has."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint metadata {source!r} is damaged or foreign: {what}")

    if not isinstance(metadata, md.Metadata):
        raise bad(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a mapping")
    # a pickle can refer to one object many times (its memo): a list of many chunks shared by many
    # keys took the product of the two in checks, hours for a file of a megabyte; each object once
    # per role: a list checked as chunks is not thereby a key path (one set for both let a key path
    # that is a chunk list through unchecked)
    checked: set[int] = set()
    checked_paths: set[int] = set()
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"a key {key!r} that is not a string")
        if isinstance(item, md.TensorStorageMetadata):
            if (not isinstance(item.properties, md.TensorProperties) or not _is_size(item.size)
                    or not isinstance(item.chunks, list)):
                raise bad(f"the entry of {key!r} is not a tensor's shape and chunks")
            if id(item.chunks) not in checked:
                checked.add(id(item.chunks))
                if not all(isinstance(c, md.ChunkStorageMetadata) and _is_size(c.offsets) and _is_size(c.sizes)
                           for c in item.chunks):
                    raise bad(f"the entry of {key!r} is not a tensor's shape and chunks")
        elif not isinstance(item, md.BytesStorageMetadata):
            raise bad(f"the entry of {key!r} is a {type(item).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise bad("storage_data is not a mapping")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, md.MetadataIndex) or not isinstance(info, filesystem._StorageInfo):
            raise bad("storage_data does not map indices to file locations")
        name = info.relative_path
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or name.startswith(".")):
            raise bad(f"shard file {name!r} is not a plain file name inside the checkpoint")
        numbers = (info.offset, info.length)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise bad(f"shard location {numbers!r} of {index.fqn!r} is not two integers >= 0")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise bad(f"transform descriptors {descriptors!r} are not strings")
    planner = metadata.planner_data
    if planner is not None:
        if not isinstance(planner, dict):
            raise bad("planner_data is not a mapping of names to key paths")
        for name, key_path in planner.items():
            if not (isinstance(name, str) and isinstance(key_path, (tuple, list))):
                raise bad("planner_data is not a mapping of names to key paths")
            if id(key_path) not in checked_paths:
                checked_paths.add(id(key_path))
                if not all(isinstance(part, (str, int)) for part in key_path):
                    raise bad("planner_data is not a mapping of names to key paths")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, md.StorageMeta):
        raise bad("storage_meta is not a StorageMeta")
    if metadata.version is not None and not isinstance(metadata.version, str):
        raise bad("version is not a string")


def load_dcp_metadata(path: str | Path) -> Any:
    """DCP ``Metadata`` from the ``.metadata`` file at ``path``, read without running code.

    Raises :class:`UnsafeCheckpointError` for a pickle that would create anything but DCP
    metadata, :class:`CheckpointError` for an empty, truncated or otherwise damaged file,
    ``FileNotFoundError`` if it is missing; one larger than :data:`METADATA_LIMIT` is damaged too.
    """
    path = Path(path)
    source = str(path)
    try:
        data = read_regular_bytes(path, METADATA_LIMIT)
    except FileTooLargeError as err:  # damaged, as a truncated one is: a resume goes past it
        raise CheckpointError(f"checkpoint metadata {source!r} is {err.reason}: the checkpoint is damaged") from None
    if not data:
        raise CheckpointError(f"checkpoint metadata {source!r} is empty (0 bytes): the checkpoint is "
                              "damaged")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, RecursionError, MemoryError) as err:
        raise CheckpointError(f"checkpoint metadata {source!r} is truncated or damaged "
                              f"({type(err).__name__}: {err})") from None
    _check_metadata(metadata, source)
    return metadata


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """DCP's ``FileSystemReader``; ``.metadata`` is read by :func:`load_dcp_metadata`
        (parsed once per checkpoint path and reader; ``metadata``: already parsed)."""

        def __init__(self, path: str | Path, *args: Any, metadata: Any = None, **kwargs: Any) -> None:
            super().__init__(path, *args, **kwargs)
            self._parsed: dict[str, Any] = {}
            if metadata is not None:
                self._parsed[str(Path(self._get_metadata_path(None)))] = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            if str(path) not in self._parsed:
                self._parsed[str(path)] = load_dcp_metadata(path)
            metadata = self._parsed[str(path)]
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


_READER: type | None = None


def SafeFileSystemReader(path: str | Path, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (a class, built lazily)
    """A ``torch.distributed.checkpoint.FileSystemReader`` whose ``read_metadata`` never runs
    code from the file (:func:`load_dcp_metadata`). DCP is imported on first use."""
    global _READER
    if _READER is None:
        _READER = _reader_class()
    return _READER(path, *args, **kwargs)
