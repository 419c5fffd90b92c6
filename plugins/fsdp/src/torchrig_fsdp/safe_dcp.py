"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner`` reads non-tensor values with ``torch.load(weights_only=False)``: a
planted checkpoint would execute code on ``load_state``. Here ``.metadata`` is unpickled with
only DCP's own metadata classes (and the torch types they hold) allowed, and non-tensor values
with ``weights_only=True``. ``allow_pickle=True`` (``load_state(..., allow_pickle=True)``) gives
DCP's own behaviour back, for checkpoints the user trusts.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torchrig.plugin import PICKLE_OPT_IN

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
#: The globals a DCP ``.metadata`` pickle may name: DCP's dataclasses and enums, torch's value types.
_ALLOWED = {
    _METADATA_MODULE: {"Metadata", "StorageMeta", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
                       "MetadataIndex", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A DCP file needs a global the safe reader does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: str) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self._path} names {module}.{name}, which a DCP checkpoint's metadata never "
                                    f"holds; refused without unpickling. {PICKLE_OPT_IN}")


def reader(path: str, allow_pickle: bool) -> Any:
    """A ``FileSystemReader`` for ``path`` whose metadata is read safely unless ``allow_pickle``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    if allow_pickle:
        return FileSystemReader(path)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as handle:
                metadata = _MetadataUnpickler(handle, str(metadata_path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_bytes(value: io.BytesIO, where: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{where} holds a value the safe loader refuses ({str(exc).splitlines()[0]}). "
                                    f"{PICKLE_OPT_IN}") from exc


def planner(path: str, allow_pickle: bool, base: type | None = None, **kwargs: Any) -> Any:
    """A load planner (``DefaultLoadPlanner`` unless ``base``) reading non-tensor values with
    ``weights_only=True`` unless ``allow_pickle``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    base = base or DefaultLoadPlanner
    if allow_pickle:
        return base(**kwargs)

    class SafePlanner(base):  # type: ignore[misc, valid-type]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = _safe_bytes(value, f"{path} (entry {fqn!r})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner(**kwargs)


__all__ = ["UnsafeCheckpointError", "planner", "reader"]
