"""``torchrig plugins``: what is installed, from which distribution, and whether it can be used.

Only manifests are loaded (torch-free): listing never imports a plugin's runtime.
"""

from __future__ import annotations

import json
import sys

from torchrig.host.plugin_host import PluginHost, PluginInfo, PluginStatus
from torchrig.host.runtime import DEFAULT_PRECISION, DEFAULT_STRATEGY

#: What a run selects when the configuration says nothing (auto-detected kinds aside).
DEFAULT_SELECTION = {f"strategy:{DEFAULT_STRATEGY}", f"precision:{DEFAULT_PRECISION}"}


def _status(info: PluginInfo) -> tuple[str, str | None]:
    """The listed status and reason. An installed plugin whose hardware is absent says so through its
    manifest's ``unavailable_reason`` (a device plugin with no device is not "available")."""
    if info.status is PluginStatus.AVAILABLE:
        absent = info.manifest.unavailable_reason() if info.manifest is not None else None
        if absent:
            return PluginStatus.UNAVAILABLE.value, absent
        if info.key in DEFAULT_SELECTION:
            return PluginStatus.SELECTED.value, None
    return info.status.value, info.reason


def listing(host: PluginHost, kind: str | None = None) -> list[dict[str, object]]:
    rows = []
    for info in host.plugins(kind):
        row = info.describe()
        row["status"], row["reason"] = _status(info)
        rows.append(row)
    return rows


def run_plugins(*, as_json: bool, kind: str | None) -> int:
    host = PluginHost()
    rows = listing(host, kind)
    if as_json:
        print(json.dumps({"plugins": rows}, indent=2))
    else:
        _print_table(rows)
    for info in host.conflicts():
        print(f"warning: {info.kind.value} plugin {info.name!r} is {info.reason}; selecting it is an error "
              f"until one is removed or chosen with '{info.name}@<distribution>'", file=sys.stderr)
    return 0


def _print_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        print("no torchrig plugins found (is torchrig installed? pip install torchrig)")
        return
    headers = ("KIND", "NAME", "DISTRIBUTION", "VERSION", "STATUS")
    table = [headers] + [
        (str(r["kind"]), str(r["name"]), str(r["distribution"]), str(r["version"]), str(r["status"])) for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    for line, row in zip(table, [None, *rows]):
        text = "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
        if row is not None and row.get("reason"):
            text += f"  ({row['reason']})"
        print(text)
