"""``load_state``: find, verify, check and restore a committed checkpoint (the load half of
:class:`~torchrig.checkpoint.manager.CheckpointManager`).

Rank 0 resolves the directory (the newest committed checkpoint; a damaged newer one is an error
unless ``skip_damaged``), validates its manifest, verifies the files against it (confined,
regular, sized; hashed when asked) and refuses a changed configuration or world size; every rank
then restores. Every pickle-based file is read with the restricted unpickler unless
``allow_pickle`` (:mod:`torchrig.checkpoint.trust`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from torchrig.checkpoint import layout, safetensors_header, topology
from torchrig.checkpoint.files import CheckpointError, describe
from torchrig.checkpoint.state import FINGERPRINT_SECTIONS, comparable_data_order, diff, reseed_rng, restore_rng
from torchrig.checkpoint.state_dicts import load_structured
from torchrig.checkpoint.trust import load_pickled
from torchrig.logging import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.ledger import CheckpointLedger
    from torchrig.distributed.collectives import Collectives

_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)
logger = get_logger(__name__)


class ManagerView(Protocol):
    """What loading uses of :class:`torchrig.checkpoint.manager.CheckpointManager`, which passes
    itself: the manager imports this half, so this half names its needs instead of the manager."""

    ledger: CheckpointLedger
    iteration: int
    load_pre_hooks: Mapping[int, Callable[..., Any]]

    @property
    def _project(self) -> Any: ...

    def checkpoints_root(self, output_dir: str | os.PathLike[str] | None = None) -> str: ...

    def _collectives(self) -> Collectives: ...

    def _fingerprint(self) -> tuple[dict[str, Any], list[dict[str, Any]]]: ...

    def _plugin_state(self) -> dict[str, Any]: ...


def load(manager: ManagerView, input_dir: str | os.PathLike[str] | None, *, allow_config_change: bool,
         allow_world_size_change: bool, verify_hashes: bool | None, allow_pickle: bool, skip_damaged: bool) -> str:
    """``verify_hashes=None``: verify the hashes a checkpoint recorded (one saved with hashes is
    always checked end to end; one saved without is checked by sizes); True: require them."""
    rank = manager.ledger.run.cluster.rank
    collectives = manager._collectives()
    found: dict[str, Any] = {}
    if rank == 0:
        try:
            directory = resolve(manager, input_dir, skip_damaged)
            manifest = layout.load_manifest(directory)
            hashes = bool(manifest.get("hashes")) if verify_hashes is None else verify_hashes
            layout.verify(directory, manifest, hashes=hashes)
            _check_safetensors_headers(directory, manifest)
            check_compatible(manager, directory, manifest, allow_config_change, allow_world_size_change)
            found = {"directory": directory}
            before, now = topology.saved(manifest), topology.current(manager.ledger.run)
            if topology.changed(before, now):
                logger.info(f"load_state: resharding from {topology.describe(before)} to {topology.describe(now)} "
                            f"(checkpoint {directory})")
        except CheckpointError as exc:
            found = {"error": str(exc)}
    found = collectives.broadcast_object_list([found])[0]
    if "error" in found:
        raise CheckpointError(found["error"])
    directory = found["directory"]
    error = None
    try:
        try:
            manifest = layout.load_manifest(directory)
        except CheckpointError as exc:
            raise CheckpointError(f"rank {rank} cannot read the manifest of {directory} (is the directory on a disk "
                                  f"this node can see?): {exc}") from exc
        restore(manager, directory, manifest, allow_pickle)
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        error = f"rank {rank}: {describe(exc)}"
    errors = [e for e in collectives.gather_object([error]) if e]
    if errors:  # every rank raises, none waits for a rank that failed
        raise CheckpointError(f"loading {directory} failed; the prepared objects are partly loaded, load again "
                              "or restart: " + "; ".join(errors))
    if rank == 0:
        layout.remove_leftovers(os.path.dirname(directory))
    return directory


def _check_safetensors_headers(directory: str, manifest: Mapping[str, Any]) -> None:
    """Every listed safetensors file's header, by the library's rules, before any rank restores
    anything: a damaged header is refused with the live state untouched, not found half-way
    (after the model loaded, at the optimizer). Headers only: a few KB per file."""
    for entry in manifest["files"]:
        if entry["path"].endswith(".safetensors"):
            safetensors_header.check_file(os.path.join(directory, entry["path"]))


def resolve(manager: ManagerView, input_dir: str | os.PathLike[str] | None, skip_damaged: bool) -> str:
    project = manager._project
    if input_dir is None:
        if not project.automatic_checkpoint_naming and not project.project_dir:
            raise CheckpointError("load_state() needs a checkpoint directory: pass load_state(input_dir) or set "
                                  "a project_dir with automatic_checkpoint_naming")
        root = manager.checkpoints_root()
        latest = layout.latest_checkpoint(root, skip_damaged=skip_damaged)
        if latest is None:
            unfinished = len(list(layout.leftovers(root)))
            extra = f" ({unfinished} unfinished save(s) there are ignored)" if unfinished else ""
            raise CheckpointError(f"no committed checkpoint in {root}{extra}; to start fresh, do not call "
                                  "load_state() (see Accelerator.latest_checkpoint())")
        return latest
    directory = os.path.abspath(os.fspath(input_dir))
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot resume from {directory}: no such directory")
    if layout.has_manifest_file(directory):  # a checkpoint: its manifest must be valid (raises naming the field)
        layout.load_manifest(directory)
        return directory
    latest = layout.latest_checkpoint(directory, skip_damaged=skip_damaged)
    if latest is not None:
        return latest
    raise CheckpointError(f"cannot resume from {directory}: it is not a committed torchrig checkpoint (no "
                          f"{layout.MANIFEST_NAME}: the save that wrote it did not finish) and holds none")


def check_compatible(manager: ManagerView, directory: str, manifest: Mapping[str, Any],
                     allow_config_change: bool, allow_world_size_change: bool) -> None:
    ledger = manager.ledger
    problems = []
    world = ledger.run.cluster.world_size
    saved_world = manifest["world_size"]
    if saved_world != world and not allow_world_size_change:
        problems.append(f"world size: checkpoint {saved_world}, now {world} (pass "
                        "load_state(..., allow_world_size_change=True) to convert; see docs/checkpoints.md)")
    config_keys, data_order = manager._fingerprint()
    saved = manifest.get("fingerprint", {})
    saved_config = dict(saved.get("config", {}))
    saved_order, data_order = comparable_data_order(saved.get("data_order") or [], data_order,
                                                    ledger.dataloaders)
    relaid = topology.changed(topology.saved(manifest), topology.current(ledger.run))
    if saved_world != world or relaid:
        # What follows from the world size or the layout is not a configuration change: the
        # strategy (single <-> data parallel, DDP -> FSDP2 x TP; the strategy's load hook
        # refuses formats it cannot read) and its options.
        for keys in (saved_config, config_keys):
            for key in [k for k in keys if k == "strategy" or "." in k and k.split(".")[0] not in FINGERPRINT_SECTIONS]:
                del keys[key]
    if saved_world != world or (topology.saved(manifest).get("data_parallel_size")
                                != topology.current(ledger.run)["data_parallel_size"]):
        saved_order, data_order = _one_batch_size(saved_order, data_order)
    if not allow_config_change:
        defaulted = [key for key in config_keys if not ledger.run.config.is_set(key)]
        lines = diff(saved_config, config_keys, defaulted)
        if saved.get("data_order") is not None and saved_order != data_order:
            lines.extend(f"data order, dataloader {line}" for line in diff(
                {str(i): v for i, v in enumerate(saved_order)}, {str(i): v for i, v in enumerate(data_order)}))
        if lines:
            problems.append("configuration changed since the checkpoint (pass load_state(..., "
                            "allow_config_change=True) to load anyway):\n    " + "\n    ".join(lines))
    contents = manifest.get("contents", {})
    for name, have in (("models", len(ledger.models)), ("schedulers", len(ledger.schedulers)),
                       ("dataloaders", len(ledger.dataloaders)), ("custom_objects", len(ledger.custom_objects))):
        if contents.get(name, have) != have:
            problems.append(f"{name}: the checkpoint has {contents.get(name)}, this run prepared/registered {have}")
    if problems:
        raise CheckpointError(f"cannot load {directory}: " + "; ".join(problems))


def _one_batch_size(saved: list[dict[str, Any]], current: list[dict[str, Any]]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Another data-parallel size (world size or mesh): the per-rank and the global batch cannot
    both stay. Keeping either is a resume; each loader compares only the one the run kept (the
    global batch when the per-rank batch changed: ``tp=2 -> dp_shard=4`` with a halved loader
    batch continues exactly as before)."""
    kept_saved, kept_current = [], []
    for index, entry in enumerate(current):
        old = saved[index] if index < len(saved) else {}
        drop = "total_batch_size" if old.get("batch_size") == entry.get("batch_size") else "batch_size"
        kept_saved.append({k: v for k, v in old.items() if k != drop})
        kept_current.append({k: v for k, v in entry.items() if k != drop})
    kept_saved += saved[len(current):]
    return kept_saved, kept_current


def _custom_file(directory: str, index: int, listed: set[str]) -> str | None:
    """The file of registered object ``index``: safetensors now; ``.bin`` (restricted pickle) or
    ``.pkl`` (checkpoints before issue 18) otherwise. Only files the manifest lists count."""
    for suffix in (".safetensors", ".bin", ".pkl"):
        name = f"custom_checkpoint_{index}{suffix}"
        if name in listed:
            return name
    return None


def restore(manager: ManagerView, directory: str, manifest: Mapping[str, Any], allow_pickle: bool) -> None:
    ledger = manager.ledger
    run = ledger.run
    rank = run.cluster.rank
    listed = {entry["path"] for entry in manifest["files"]}
    prepared = list(ledger.models)
    if manager.load_pre_hooks:
        models = [item.model for item in prepared]
        kept = list(models)
        for hook in manager.load_pre_hooks.values():
            hook(kept, directory)
        prepared = [item for item, model in zip(prepared, models) if any(m is model for m in kept)]
    try:
        ledger.host.hook.torchrig_load_strategy_state(run=run, prepared=prepared, directory=directory,
                                                            manifest=manifest, allow_pickle=allow_pickle)
    except _PASS_THROUGH:
        raise
    except BaseException as exc:  # DCP raises BaseException subclasses
        raise CheckpointError(f"cannot load the models and optimizers of {directory}: {describe(exc)}") from exc

    def read(name: str, what: str) -> Any:
        if name not in listed:
            raise CheckpointError(f"{directory} has no {name} ({what}) in its manifest")
        return load_pickled(os.path.join(directory, name), what, allow_pickle=allow_pickle)

    for index, scheduler in enumerate(ledger.schedulers):
        scheduler.load_state_dict(read(layout.numbered("scheduler", index, ".bin"), f"scheduler {index}"))
    for index, loader in enumerate(ledger.dataloaders):
        name = layout.numbered("dl_state_dict", index, ".bin")
        if hasattr(loader, "load_state_dict") and name in listed:
            loader.load_state_dict(read(name, f"dataloader {index}"))
    for name, obj in manager._plugin_state().items():
        path = f"{name}.pt"
        if path not in listed:
            raise CheckpointError(f"{directory} has no {path} for the plugin state {name!r} this run has (was it "
                                  "saved with another precision or strategy?)")
        obj.load_state_dict(read(path, f"plugin state {name!r}"))
    for index, obj in enumerate(ledger.custom_objects):
        name = _custom_file(directory, index, listed)
        if name is None:
            raise CheckpointError(f"{directory} has no file for registered object {index} ({type(obj).__name__})")
        if name.endswith(".safetensors"):
            obj.load_state_dict(load_structured(directory, name[:-len(".safetensors")]))
        else:
            obj.load_state_dict(read(name, f"registered object {index} ({type(obj).__name__})"))
    rng_file = f"random_states_{rank}.pkl"
    if rng_file in listed:
        restore_rng(read(rng_file, f"the RNG state of rank {rank}"))
    else:
        reseed_rng(manifest["sequence"], rank)
    ledger.gradient_state.step = manifest.get("accumulation_step", 0)
    if manifest.get("iteration") is not None:
        manager.iteration = manifest["iteration"] + 1


__all__ = ["ManagerView", "check_compatible", "load", "resolve", "restore"]
