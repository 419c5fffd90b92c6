"""The DeepSpeed JSON (``deepspeed_config.hf_ds_config``) read into a mapping with file:line marks.

Apart from :mod:`torchrig_deepspeed.config_checks` because the options class converts with it
and is imported for every run (the manifest declares it), while the checks run only when the
deepspeed strategy is selected.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from typing import Any

import attrs
from torchrig.plugin import ConfigDocument, ConfigError, load_config_text


@attrs.frozen
class DeepSpeedJSON:
    """The DeepSpeed configuration as a mapping, with the document it came from (None for a
    mapping passed from Python or base64 text) so problems can name file:line."""

    data: dict[str, Any]
    document: ConfigDocument | None = None

    def where(self, *path: str | int) -> str | None:
        return self.document.where(path) if self.document is not None else None

    def describe(self, *path: str | int) -> str:
        """``'zero_optimization.stage' (ds.json:4:5)`` or ``'zero_optimization.stage' in the DeepSpeed config``."""
        name = ".".join(str(p) for p in path)
        where = self.where(*path)
        return f"{name!r} ({where})" if where else f"{name!r} in the DeepSpeed config"


def load_deepspeed_json(value: Any) -> DeepSpeedJSON:
    """``hf_ds_config`` -> :class:`DeepSpeedJSON`. A path is read as JSON (duplicate keys are errors
    with file:line), else as hjson, which DeepSpeed also accepts (JSON with comments); text that is
    no file is tried as base64 JSON, as DeepSpeed does. Raises :class:`ConfigError`."""
    if isinstance(value, Mapping):
        return DeepSpeedJSON(dict(value))
    if not isinstance(value, str):
        raise ConfigError(f"expected a DeepSpeed config file path or a mapping, got {value!r}")
    if os.path.isfile(value):
        return DeepSpeedJSON(*_read_file(value))
    decoded = _base64_json(value)
    if decoded is not None:
        return DeepSpeedJSON(decoded)
    if os.path.isdir(value):
        raise ConfigError(f"{value}: is a directory, not a DeepSpeed config file")
    raise ConfigError(f"{value}: no such DeepSpeed config file (relative paths are relative to the working directory "
                      f"{os.getcwd()})")


def _read_file(path: str) -> tuple[dict[str, Any], ConfigDocument | None]:
    try:
        with open(path, encoding="utf-8-sig") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the DeepSpeed config: {exc}") from None
    try:
        document = load_config_text(text, path, format="json")
        return document.data, document
    except ConfigError as json_error:
        if any("duplicate key" in p for p in json_error.problems):
            raise
        data = _hjson(text)
        if data is None:
            raise
        return data, None


def _hjson(text: str) -> dict[str, Any] | None:
    """hjson (DeepSpeed's own reader) for files with comments; None if it is not hjson either."""
    try:
        import hjson
    except ImportError:
        return None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in items:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = item
        return out

    try:
        data = hjson.loads(text, object_pairs_hook=pairs)
    except Exception:
        return None
    return dict(data) if isinstance(data, Mapping) else None


def _base64_json(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8"))
    except (ValueError, UnicodeError, binascii.Error):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["DeepSpeedJSON", "load_deepspeed_json"]
