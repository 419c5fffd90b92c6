"""``torchrig new-plugin NAME KIND [--dir DIR]``: render a working plugin distribution.

The rendered package is what a plugin author starts from: ``pyproject.toml`` with both entry
points (runtime and manifest) under ``NAME``, a torch-free manifest declaring a config section
and a ``torchrig launch`` flag, a runtime with one hook implementation that works as it is, a test
module subclassing the contract of ``KIND`` from :mod:`torchrig.testing.contracts`, and a README.
``pip install -e DIR`` and ``torchrig plugins`` lists it; ``cd DIR && python -m pytest`` runs the
contract. Torch-free (it only writes text files).
"""

from __future__ import annotations

import keyword
import os
import re
import string
from collections.abc import Mapping

from torchrig._version import __version__
from torchrig.errors import TorchrigError
from torchrig.plugin.kinds import PluginKind

_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class NewPluginError(TorchrigError):
    """A usage problem of ``torchrig new-plugin`` (exit 2)."""


def _pyproject(kind: PluginKind) -> str:
    return f'''[build-system]
requires = ["setuptools>=64"]  # editable installs (PEP 660)
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "$title $kind plugin for torchrig."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["torchrig>={__version__}"]

# Two entry points under the plugin's user-facing name: the runtime, imported only when the plugin
# is selected, and the torch-free manifest, loaded for every installed plugin (torchrig plugins,
# torchrig launch --help, configuration validation).
[project.entry-points."{kind.runtime_group}"]
$name = "$package.runtime:$cls"

[project.entry-points."{kind.manifest_group}"]
$name = "$package.manifest:${{cls}}Manifest"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-p torchrig.testing.pytest_plugin"
'''


_INIT = '''"""$dist: the torchrig $kind plugin `$name`. See README.md."""

__version__ = "0.1.0"
'''

#: Per kind: (options class body or None, CLI flag line or None, manifest extras, runtime module, test module).
_OPTIONS = '''"""The `${name}_config` section: this plugin's options. Torch-free (the manifest imports it)."""

from __future__ import annotations

import attrs

from torchrig.plugin import $validators, option


@attrs.frozen(kw_only=True)
class ${cls}Options:
$fields
'''

_MANIFEST = '''"""Manifest of the $kind plugin `$name`: what torchrig knows about it without importing torch.

Loaded for every installed plugin (torchrig plugins, torchrig launch --help, configuration
validation): keep it importable without torch and without this plugin's heavy dependencies.
"""

from __future__ import annotations

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigSection, PluginManifest


class ${cls}Manifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "$summary"
    install_hint = "$dist"
    #: Top-level modules the runtime imports; a missing one makes the plugin *unavailable* with install_hint.
    requires = ()
    priority = $priority
$section'''

_SECTIONS = {
    # The options class by reference: imported only by runs that use the section.
    "section": '''    config_section = ConfigSection("${name}_config", "${package}.options:${cls}Options", help="$section_help")
    cli_flags = (
        CliFlag("--${name}_$flag_field", "${name}_config.$flag_field", "$flag_help", $flag_kwargs),
    )
''',
    "none": '''    # A plugin with options declares them here: config_section = ConfigSection("<key>", "package.options:Class")
    # and cli_flags = (CliFlag("--flag", "<key>.<field>", "help"),). This kind's hook receives
    # only the environment, so this one has none.
''',
}

_KINDS: dict[PluginKind, dict[str, str]] = {
    PluginKind.STRATEGY: {
        "summary": "data parallelism through DistributedDataParallel (rendered by torchrig new-plugin)",
        "priority": "0",
        "validators": "at_least",
        "fields": '''    bucket_cap_mb: int = option(25, help="gradient bucket size in MiB for all-reduce", validator=at_least(1))
''',
        "section_help": "gradient bucketing",
        "flag_field": "bucket_cap_mb", "flag_help": "gradient bucket size in MiB", "flag_kwargs": 'type="int"',
        "runtime": '''"""The runtime of the strategy `$name`: one hook implementation, ``torchrig_prepare_model``.

Every other hook keeps the core's default: capabilities (every rank is a data-parallel rank),
the plain-PyTorch step plan (whose ``no_sync`` uses ``DistributedDataParallel.no_sync`` on
accumulation micro-steps), plain state-dict checkpoints. See docs/plugins.md for the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from torchrig.plugin import PreparedModel, RunContext, hookimpl
$options_import

class $cls:
    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        assert run.device is not None
        if device_placement:
            model.to(run.device.device)
        wrapped = model
        if run.cluster.world_size > 1:
            device = run.device.device
            wrapped = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=run.section(${cls}Options).bucket_cap_mb)  # the default lives on the class
        return PreparedModel(model=wrapped, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))
''',
        "test": '''"""The contract of every torchrig strategy, run against `$name` on two gloo ranks."""

from torchrig.testing.contracts import StrategyContract


class Test${cls}Contract(StrategyContract):
    strategy = "$name"
    world_size = 2
    invalid_configs = [({"${name}_config": {"bucket_cap_mb": 0}}, "${name}_config.bucket_cap_mb")]
''',
        "select": "strategy: $name",
    },
    PluginKind.PRECISION: {
        "summary": "autocast in a configurable dtype (rendered by torchrig new-plugin)",
        "priority": "0",
        "validators": "enum_name",
        "fields": '''    dtype: str = option("bfloat16", help="autocast dtype: bfloat16 or float16", choices=("bfloat16", "float16"))
''',
        "section_help": "the autocast dtype",
        "flag_field": "dtype", "flag_help": "autocast dtype", "flag_kwargs": 'choices=("bfloat16", "float16")',
        "runtime": '''"""The runtime of the precision `$name`: one hook implementation, ``torchrig_precision_step_plan``.

It sets the ``autocast`` slot of the step plan once, at prepare; the training step then calls
the plain callable (no hook call per step). A precision that scales the loss also wraps
``backward``, ``unscale_gradients`` and ``optimizer_step`` (see ``torchrig.training.step_plan``).
"""

from __future__ import annotations

from typing import Any

import torch

from torchrig.plugin import RunContext, StepPlanBuilder, hookimpl
$options_import

class $cls:
    @hookimpl
    def torchrig_precision_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        assert run.device is not None
        device_type = run.device.autocast_device_type
        dtype = getattr(torch, run.section(${cls}Options).dtype)  # the default lives on the class

        def autocast() -> Any:
            return torch.autocast(device_type=device_type, dtype=dtype)

        plan.set("autocast", autocast)
''',
        "test": '''"""The contract of every torchrig precision, run against `$name` on the CPU."""

from torchrig.testing.contracts import PrecisionContract


class Test${cls}Contract(PrecisionContract):
    precision = "$name"
    autocast_dtype = "bfloat16"
''',
        "select": "mixed_precision: $name",
    },
    PluginKind.DEVICE: {
        "summary": "the CPU under another name: a starting point for a new device (rendered by torchrig new-plugin)",
        "priority": "-10",
        "validators": "enum_name",
        "fields": '''    dist_backend: str = option("gloo", help="process-group backend for this device", choices=("gloo",))
''',
        "section_help": "the process-group backend",
        "flag_field": "dist_backend", "flag_help": "process-group backend", "flag_kwargs": 'choices=("gloo",)',
        "runtime": '''"""The runtime of the device `$name`: one hook implementation, ``torchrig_select_device``.

It answers with a :class:`torchrig.DeviceBackend` (the torch device, its process-group backend,
seeding, RNG state, memory) when its hardware is present, and ``None`` otherwise so the next
device plugin is asked. This starting point drives the CPU; a real device returns its own
``torch.device`` and overrides the backend's methods. Its priority (-10, in the manifest) keeps
auto-detection choosing ``cpu``; select it with ``device: $name``.
"""

from __future__ import annotations

import torch

from torchrig.plugin import DeviceBackend, RunContext, hookimpl
$options_import

class ${cls}Backend(DeviceBackend):
    name = "$name"

    def __init__(self, dist_backend: str) -> None:
        super().__init__(torch.device("cpu"))
        self.dist_backend = dist_backend


class $cls:
    @hookimpl
    def torchrig_select_device(self, run: RunContext) -> DeviceBackend | None:
        return ${cls}Backend(run.section(${cls}Options).dist_backend)  # the default lives on the class
''',
        "test": '''"""The contract of every torchrig device, run against `$name`."""

from torchrig.testing.contracts import DeviceContract


class Test${cls}Contract(DeviceContract):
    device = "$name"
    device_type = "cpu"
    priority = -10
''',
        "select": "device: $name",
    },
    PluginKind.CLUSTER: {
        "summary": "jobs that export ${upper}_RANK, ${upper}_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (rendered by torchrig new-plugin)",
        "priority": "20",
        "runtime": '''"""The runtime of the cluster environment `$name`: one hook implementation, ``torchrig_detect_cluster``.

It answers only for processes its scheduler started (here: ``${upper}_RANK`` is set), else
``None`` so the next cluster plugin is asked; malformed values raise ``ValueError`` naming the
variable. Auto-detection asks cluster plugins by priority (torchelastic 50, slurm 40, mpi 30,
this one 20, local -100); ``cluster: $name`` asks only this one.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.plugin import ClusterInfo, hookimpl

PREFIX = "${upper}_"


def _int(environ: Mapping[str, str], name: str, default: str | None = None) -> int:
    raw = environ.get(name, default)
    if raw is None:
        raise ValueError(f"$name: {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"$name: {name}={raw!r} is not an integer") from None


class $cls:
    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        if PREFIX + "RANK" not in environ:
            return None
        rank, world = _int(environ, PREFIX + "RANK"), _int(environ, PREFIX + "WORLD_SIZE")
        local_rank = _int(environ, PREFIX + "LOCAL_RANK", "0")
        local_world = _int(environ, PREFIX + "LOCAL_WORLD_SIZE", "1")
        if not 0 <= rank < world:
            raise ValueError(f"$name: {PREFIX}RANK={rank} is not below {PREFIX}WORLD_SIZE={world}")
        if world > 1 and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
            raise ValueError(f"$name: rank {rank} of {world} needs MASTER_ADDR and MASTER_PORT exported")
        return ClusterInfo(
            rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            node_rank=rank // local_world, num_nodes=-(-world // local_world),
            master_addr=environ.get("MASTER_ADDR") if world > 1 else None,
            master_port=_int(environ, "MASTER_PORT") if world > 1 else None, source="$name")
''',
        "test": '''"""The contract of every torchrig cluster environment, run against `$name` on recorded environments."""

from torchrig.testing.contracts import ClusterContract

JOB = {"${upper}_RANK": "3", "${upper}_WORLD_SIZE": "4", "${upper}_LOCAL_RANK": "1", "${upper}_LOCAL_WORLD_SIZE": "2",
       "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "HOME": "/home/user"}


class Test${cls}Contract(ClusterContract):
    cluster = "$name"
    priority = 20
    environments = [
        (JOB, {"rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2, "node_rank": 1, "num_nodes": 2,
               "master_addr": "node0", "master_port": 29400}),
        ({"HOME": "/home/user"}, None),
    ]
    malformed = [(JOB | {"${upper}_RANK": "x"}, "${upper}_RANK"), (JOB | {"${upper}_RANK": "4"}, "${upper}_RANK=4")]
''',
        "select": "cluster: $name",
    },
    PluginKind.TRACKER: {
        "summary": "metrics as text lines under the logging directory (rendered by torchrig new-plugin)",
        "priority": "0",
        "validators": "enum_name",
        "fields": '''    filename: str = option("metrics.txt", help="file written under <logging_dir>/<project>/")
''',
        "section_help": "the metrics file",
        "flag_field": "filename", "flag_help": "metrics file name", "flag_kwargs": 'metavar="FILE"',
        "runtime": '''"""The runtime of the tracker `$name`: one hook implementation, ``torchrig_create_trackers``.

It returns :class:`torchrig.Tracker` objects, created cheaply (no I/O: files are opened in
``start``). The core runs them on the main process only, each behind its own bounded queue and
thread, so a tracker that fails or blocks never stops training.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchrig.plugin import RunContext, Tracker, as_scalar, flatten, hookimpl
$options_import

class ${cls}Tracker(Tracker):
    name = "$name"
    requires_logging_directory = True

    def __init__(self, directory: str, filename: str) -> None:
        self.path = os.path.join(directory, filename)
        self._file: Any = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the run

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        for key, value in flatten(values).items():
            scalar = as_scalar(value)
            if scalar is not None:
                self._file.write(f"{step} {key} {float(scalar)!r}\\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class $cls:
    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        directory = os.path.join(logging_dir or os.getcwd(), project_name)
        return [${cls}Tracker(directory, run.section(${cls}Options).filename)]  # the default lives on the class
''',
        "test": '''"""The contract of every torchrig tracker, run against `$name`."""

from torchrig.testing.contracts import TrackerContract


class Test${cls}Contract(TrackerContract):
    tracker = "$name"

    def read_back(self, logging_dir, project):
        lines = (logging_dir / project / "metrics.txt").read_text().splitlines()
        return [(int(step), float(value)) for step, key, value in (line.split() for line in lines) if key == "loss"]
''',
        "select": "log_with: [$name]",
    },
}

_README = '''# $dist

The torchrig $kind plugin `$name`, rendered by `torchrig new-plugin $name $kind`.

```bash
pip install -e .                  # installs the plugin; torchrig discovers it through its entry points
torchrig plugins --kind $kind     # lists `$name` ($dist 0.1.0, available)
python -m pytest                  # runs torchrig's $kind contract against it
```

Select it in a config file (`torchrig launch --config_file run.yaml train.py`):

```yaml
$select
```

Files: `pyproject.toml` (the distribution and its two entry points), `src/$package/manifest.py`
(torch-free: hook-API version, summary, priority, config section and flags),
`src/$package/runtime.py` (one hook implementation), `tests/` (the contract). The hooks, their
order and the contracts are described in torchrig's docs/plugins.md.
'''


def _title(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def render(name: str, kind: PluginKind | str) -> dict[str, str]:
    """The files of a new plugin distribution, relative path -> text."""
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise NewPluginError(
            f"invalid plugin name {name!r}: use lower-case letters, digits and underscores, starting with a letter "
            "(it is the name users write in configuration, e.g. `strategy: my_strategy`)")
    kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
    spec = _KINDS[kind]
    cls = _title(name) + kind.value.capitalize()
    values: dict[str, str] = {
        "name": name, "kind": kind.value, "dist": f"torchrig-{name.replace('_', '-')}", "package": f"torchrig_{name}",
        "cls": cls, "title": _title(name), "upper": name.upper(),
    }
    values["summary"] = string.Template(spec["summary"]).substitute(values)
    values["priority"] = spec["priority"]
    values["select"] = string.Template(spec["select"]).substitute(values)
    has_options = "fields" in spec
    if has_options:
        values.update({k: spec[k] for k in ("validators", "fields", "section_help", "flag_field", "flag_help",
                                              "flag_kwargs")})
        values["validators"] = "at_least" if "at_least" in spec["fields"] else values["validators"]
        values["options_import"] = f"from {values['package']}.options import {cls}Options\n"
        values["section"] = string.Template(_SECTIONS["section"]).substitute(values)
    else:
        values["options_import"] = ""
        values["section"] = string.Template(_SECTIONS["none"]).substitute(values)

    def fill(template: str) -> str:
        return string.Template(template).substitute(values)

    package = f"src/{values['package']}"
    files = {
        "pyproject.toml": fill(_pyproject(kind)),
        "README.md": fill(_README),
        f"{package}/__init__.py": fill(_INIT),
        f"{package}/manifest.py": fill(_MANIFEST),
        f"{package}/runtime.py": fill(spec["runtime"]),
        f"tests/test_{name}_{kind.value}.py": fill(spec["test"]),
    }
    if has_options:
        options = fill(_OPTIONS)
        if "enum_name" in options and "enum_name(" not in options:  # only the helper that is used is imported
            options = options.replace("import enum_name, option", "import option")
        files[f"{package}/options.py"] = options
    return files


def write(files: Mapping[str, str], directory: str) -> None:
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise NewPluginError(f"{directory} already exists and is not an empty directory; choose another with --dir DIR")
    for relative, text in files.items():
        path = os.path.join(directory, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def run_new_plugin(name: str, kind: str, directory: str | None) -> int:
    try:
        parsed = PluginKind.parse(kind)
    except ValueError as exc:
        raise NewPluginError(str(exc)) from None
    files = render(name, parsed)
    target = directory or f"torchrig-{name.replace('_', '-')}"
    write(files, target)
    print(f"created the {parsed.value} plugin {name!r} in {target}:")
    for relative in sorted(files):
        print(f"  {relative}")
    print(f"next: pip install -e {target} && torchrig plugins --kind {parsed.value} && "
          f"(cd {target} && python -m pytest)")
    return 0


__all__ = ["NewPluginError", "render", "run_new_plugin", "write"]
