"""FSDP checkpoint shards (torch.distributed.checkpoint) read back without unpickling what a run folder could plant.

DCP keeps a checkpoint's index as a pickle (SHARDS/.metadata) and its non-tensor items (the optimiser's
param_groups) as torch.save pickles; torch's own FileSystemReader and DefaultLoadPlanner unpickle both as they come
(the planner with weights_only=False), so a `__reduce__` planted in a shared, copied or downloaded run folder would
run on every rank at `--resume`. Here nothing is unpickled freely:

- `read_metadata(folder)`: the index through `_IndexUnpickler`, which admits only DCP's own metadata classes,
  torch.Size, torch's dtypes and layouts and pathlib's paths; a file naming anything else is refused in one line
  naming it (UserError), a cut one is `Damaged`; then every entry must name a plain shard file of this folder.
- `shards_damage(folder)`: what is wrong with the shards (index cut or missing, a shard file missing or shorter than
  the index says), or None; `bridgelm.train.checkpoints.checkpoint_damage` passes such a checkpoint over, as a
  damaged plain one.
- `load_shards(state, folder)`: `dcp.load` through `SafeReader` (the index as above) and `SafePlanner` (non-tensor
  items by torch.load weights_only=True); an error raised on a rank comes out as itself, not as DCP's
  CheckpointException (a BaseException, which would escape the command line's one-line errors).

Used by bridgelm.dist (load_model_shards, load_optimizer_shards) and bridgelm.runs; tested by tests/test_hostile_3.py
and tests/test_train_distributed.py.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from bridgelm.errors import UserError

INDEX = ".metadata"  # DCP's index of a checkpoint's shards

# The globals DCP's index pickles: its metadata dataclasses, the storage info of FileSystemWriter, torch.Size, a dtype
# or layout of a tensor's properties, and the checkpoint's path (StorageMeta.checkpoint_id). Calling any of them with
# whatever arguments builds a value and runs nothing else.
_METADATA_CLASSES = (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path().__class__,
    ("pathlib", "WindowsPath"): Path().__class__,
    # Python 3.13 moved the path classes into pathlib._local, and pickles a path under that name
    ("pathlib._local", "PosixPath"): Path().__class__,
    ("pathlib._local", "WindowsPath"): Path().__class__,
}


class Damaged(Exception):
    """The shards' files are cut or missing: the checkpoint is passed over like any damaged one."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's index and nothing else: a global outside `_ALLOWED` (os.system, a class of the attacker's
    choosing) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Forbidden(f"{module}.{name}")


class _Forbidden(pickle.UnpicklingError):
    pass


def _refuse(path: Path, what: str) -> UserError:
    return UserError(
        f"{path} {what}, which a checkpoint's shard index never holds, so it was not loaded (loading it could run "
        "code): expected the .metadata torch.distributed.checkpoint writes; do not resume from a checkpoint you did "
        "not write"
    )


def read_metadata(folder: str | os.PathLike) -> dcp_metadata.Metadata:
    """The index of the shards in `folder`, read by `_IndexUnpickler` and checked: UserError (one line naming the file)
    for anything but DCP's own index; `Damaged` for a missing or cut one."""
    path = Path(folder) / INDEX
    try:
        with open(path, "rb") as f:
            index = _IndexUnpickler(f).load()
    except _Forbidden as err:
        raise _refuse(path, f"names {err}") from None
    except FileNotFoundError:
        raise Damaged(f"{INDEX} is missing") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise Damaged(f"{INDEX} does not read back ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(index, dcp_metadata.Metadata) or not isinstance(index.storage_data, dict):
        raise _refuse(path, f"holds a {type(index).__name__}")
    for key, where in index.storage_data.items():
        if not (isinstance(key, dcp_metadata.MetadataIndex) and isinstance(where, _StorageInfo) and _plain(where)):
            raise _refuse(path, f"has the entry {key!r}: {where!r}")
    return index


def _plain(where: _StorageInfo) -> bool:
    """A storage entry as FileSystemWriter writes it: a file of this folder, a span in it, no transforms."""
    name = where.relative_path
    spans = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (where.offset, where.length))
    local = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
    return spans and local and not where.transform_descriptors


def shards_damage(folder: str | os.PathLike) -> str | None:
    """What is wrong with the shards in `folder` (index missing or cut, a shard file missing or shorter than its
    index says), or None. UserError for an index that is not DCP's (`read_metadata`)."""
    folder = Path(folder)
    try:
        index = read_metadata(folder)
    except Damaged as err:
        return f"{folder.name}/{err}"
    ends: dict[str, int] = {}
    for where in index.storage_data.values():
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), where.offset + where.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            has = "is missing" if size is None else f"has {size} bytes, its index {end}"
            return f"{folder.name}/{name} {has}"
    return None


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with the index read by `read_metadata` (tensors it reads with weights_only=True)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # a rank's own index: bridgelm's checkpoints have one for all
            raise UserError(f"{self.path}: expected one {INDEX} for all ranks (torch.distributed.checkpoint)")
        index = _checked_index(self.path)
        index.storage_meta = dcp_metadata.StorageMeta(load_id=self.load_id)
        return index


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner with its non-tensor items read by torch.load(weights_only=True): plain values
    (an optimiser's param_groups), never objects."""

    def __init__(self, folder: str | os.PathLike, allow_partial_load: bool = False):
        super().__init__(allow_partial_load=allow_partial_load)
        self.folder = folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(
                f"{self.folder}: the item {fqn} holds objects other than plain values, so it was not loaded (loading "
                "them could run code): expected shards written by bridgelm; do not resume from a checkpoint you "
                "did not write"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _checked_index(folder: str | os.PathLike) -> dcp_metadata.Metadata:
    """`read_metadata`, a damaged index a UserError too (a resume has passed over damaged checkpoints before)."""
    try:
        return read_metadata(folder)
    except Damaged as err:
        raise UserError(f"{folder} is damaged ({err}): expected a whole checkpoint") from None


def load_shards(state: dict, folder: str | os.PathLike, partial: bool = False) -> None:
    """`dcp.load(state)` from `folder` through SafeReader and SafePlanner; the first rank's error re-raised as
    itself (a UserError stays one line). The index is checked first: DCP would take a refusal of its reader for a
    missing index and look for another. `partial`: entries of `state` the shards lack keep their values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _checked_index(folder)
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner(folder, allow_partial_load=partial))
    except CheckpointException as err:
        failures = err.failures
        if not failures:
            raise
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
        raise exc from None
