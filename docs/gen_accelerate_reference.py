"""Regenerate the name tables of docs/accelerate.md from the declared Accelerate name table.

    python docs/gen_accelerate_reference.py > /tmp/names.md

Everything between the ``<!-- names:begin -->`` and ``<!-- names:end -->`` markers of
docs/accelerate.md is this script's output, so the document cannot drift from
``torchrig.compat.accelerate_names``; tests/compat/test_accelerate_names.py checks it. Torch-free.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from torchrig.compat.accelerate_names import ACCELERATE_SOURCE, TABLE
from torchrig.compat.resolve import torchrig_path
from torchrig.compat.targets import FromPlugin, Refused

BEGIN, END = "<!-- names:begin -->", "<!-- names:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def generated_section() -> str:
    counts = {"implemented": 0, "plugin": 0, "refused": 0}
    per_module: dict[str, dict[str, int]] = {}
    refusals: dict[Refused, list[str]] = defaultdict(list)
    provided: dict[str, list[str]] = defaultdict(list)
    for module, names in TABLE.items():
        if module.startswith("accelerate.utils.") and all(TABLE["accelerate.utils"].get(n) == t for n, t in names.items()):
            continue  # a mirrored utils submodule repeats accelerate.utils' entries
        row = per_module[module] = {"implemented": 0, "plugin": 0, "refused": 0}
        for name, target in sorted(names.items()):
            path = f"`{torchrig_path(module)}.{name}`"
            if isinstance(target, Refused):
                kind = "refused"
                refusals[target].append(path)
            elif isinstance(target, FromPlugin):
                kind = "plugin"
                fallback = f" (without one: `{target.fallback}`)" if target.fallback else ""
                provided[f"{_cell(target.provided_by)}{fallback}"].append(path)
            else:
                kind = "implemented"
            counts[kind] += 1
            row[kind] += 1
    lines = [BEGIN, "",
             (f"Generated from `torchrig.compat.accelerate_names` (the names of {ACCELERATE_SOURCE}) by "
              f"`python docs/gen_accelerate_reference.py`: {sum(counts.values())} names in {len(per_module)} module "
              f"paths, {counts['implemented']} implemented by torchrig, {counts['plugin']} provided by plugins, "
              f"{counts['refused']} refused."), "",
             "| module | names | implemented | from a plugin | refused |", "|---|---|---|---|---|",
             *(f"| `{torchrig_path(module)}` | {sum(row.values())} | {row['implemented']} | {row['plugin']} | "
               f"{row['refused']} |" for module, row in per_module.items()), "",
             "### Names a plugin provides", "",
             ("Resolved from the installed plugins' manifests (`exports`); when none provides one, importing it "
              "raises `RefusedNameError` naming what does."), "",
             "| names | provided by |", "|---|---|",
             *(f"| {', '.join(paths)} | {by} |" for by, paths in provided.items()), "",
             "### Refused names", "",
             "Each raises `torchrig.compat.targets.RefusedNameError` (an `ImportError`) with this reason.", "",
             "| names | why | instead |", "|---|---|---|"]
    for refusal, paths in refusals.items():
        lines.append(f"| {', '.join(paths)} | {_cell(refusal.reason)} | {_cell(refusal.instead)} |")
    lines += ["", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(generated_section() + "\n")
