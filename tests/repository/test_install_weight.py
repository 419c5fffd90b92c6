"""What ``pip install torchrig[...]`` pulls (issue 41, item 8): the libraries the test suite runs for real
(Ray, MLflow, W&B, TensorBoard, transformers, peft, datasets, bitsandbytes, DeepSpeed, torchao) reach a
user only through the extra named for them (or ``all``), never through the core, DDP, FSDP or another
extra. Read from the distributions' own ``pyproject.toml`` files, as pip resolves them: first-party names
are followed into their directories, extras included."""

from __future__ import annotations

import pathlib
import re

import pytest
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
PROJECTS = {tomllib.loads(path.read_text())["project"]["name"]: tomllib.loads(path.read_text())["project"]
            for path in [REPO / "core" / "pyproject.toml", *sorted((REPO / "plugins").glob("*/pyproject.toml"))]}
#: Heavy or test-only libraries -> the extras of ``torchrig`` that may bring each.
HEAVY = {
    "ray": {"ray", "all"}, "mlflow": {"mlflow", "all"}, "wandb": {"wandb", "all"},
    "tensorboard": {"tensorboard", "all"}, "deepspeed": {"deepspeed", "all"}, "torchao": {"fp8", "all"},
    "transformers": {"examples"}, "peft": set(), "datasets": set(), "bitsandbytes": set(),
    "accelerate": {"bench"}, "lightning": {"bench"},
}
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?")


def closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution name ``name[extras]`` pulls, first-party ones followed through their pyproject."""
    seen: set[tuple[str, str]] = set()
    pulled: set[str] = set()
    pending = [(name, extra) for extra in ("", *extras)]
    while pending:
        dist, extra = pending.pop()
        if (dist, extra) in seen:
            continue
        seen.add((dist, extra))
        pulled.add(dist)
        project = PROJECTS.get(dist)
        if project is None:
            continue
        requirements = project.get("dependencies", []) if not extra else \
            project.get("optional-dependencies", {}).get(extra, [])
        for requirement in requirements:
            match = REQUIREMENT.match(requirement)
            assert match, f"{dist}: unreadable requirement {requirement!r}"
            child = match[1].lower().replace("_", "-")
            pending.append((child, ""))
            pending.extend((child, sub.strip()) for sub in (match[2] or "").split(",") if sub.strip())
    return pulled


def test_every_first_party_requirement_is_followed():
    assert {"torchrig", "torchrig-ddp", "torchrig-fsdp", "torchrig-trackers"} <= set(PROJECTS)
    assert "torchrig-ddp" in closure("torchrig")  # DDP comes with the core


@pytest.mark.parametrize("extra", [None, *PROJECTS["torchrig"].get("optional-dependencies", {})])
def test_heavy_libraries_come_only_with_the_extra_named_for_them(extra):
    pulled = closure("torchrig", (extra,) if extra else ())
    unasked = sorted(library for library, extras in HEAVY.items() if library in pulled and extra not in extras)
    assert not unasked, f"pip install 'torchrig{f'[{extra}]' if extra else ''}' would also pull {unasked}"


def test_the_core_alone_pulls_only_what_it_imports():
    third_party = {name for name in closure("torchrig") if name not in PROJECTS}
    assert third_party == {"torch", "pluggy", "attrs", "pyyaml", "safetensors", "packaging"}
