"""``save_state`` / ``load_state``: the whole state of a run, through the commit protocol.

Save (every rank, collectively):

1. rank 0 checks the target (an existing committed checkpoint is refused unless ``overwrite``),
   removes what dead writers left (only directories whose owner record proves it, see
   :mod:`~torchrig.checkpoint.temporaries`) and claims the hidden temporary sibling
   ``.<name>.tmp-<token>``; the decision is broadcast so every rank fails the same way;
2. every rank writes its files through a :class:`~torchrig.checkpoint.files.CheckpointWriter`
   (fsynced, sized, hashed while streaming when hashes are on): the strategy's models and
   optimizers (``torchrig_save_strategy_state``), and the core's schedulers, dataloader
   positions, plugin state (``torchrig_checkpoint_state``), custom objects and per-rank RNG;
3. every rank sends rank 0 its file list, or its error; one failed rank fails the save on all
   ranks, the temporary directory is removed and the previous checkpoint stays the latest;
4. rank 0 checks every file on disk against the reports, writes the manifest, renames the
   directory into place (the commit point; an overwrite is an atomic directory exchange), fsyncs
   the parent, updates ``latest`` and only then deletes automatically named checkpoints beyond
   ``total_limit``; the outcome is broadcast.

With ``async_save`` step 2 only copies the state to CPU memory — sharded state too: a strategy stages
its DCP shards on the CPU and hands the write to ``writer.library_write`` — and the files, the
agreement and the commit run on a background thread over a dedicated gloo group (DCP's collectives
too), so training never waits on the disk and no step makes a collective. A failed background save is raised on every rank at the
next ``save_state``, ``load_state``, ``wait_for_everyone`` or ``end_training``; a save still
running when the script ends is finished at exit (:mod:`~torchrig.checkpoint.pending`).

Loading is :mod:`~torchrig.checkpoint.loading`.
"""

from __future__ import annotations

import collections
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchrig._version import __version__
from torchrig.checkpoint import faults, layout, loading, temporaries, topology
from torchrig.checkpoint.files import (
    CheckpointError,
    CheckpointWriter,
    FileRecord,
    describe,
    describe_os_error,
    fsync_path,
    hash_file,
)
from torchrig.checkpoint.ledger import CheckpointLedger
from torchrig.checkpoint.manifest import read_manifest
from torchrig.checkpoint.pending import PendingSave
from torchrig.checkpoint.state import capture_rng, describe_dataloader, digest, fingerprint_config
from torchrig.checkpoint.state_dicts import save_structured
from torchrig.checkpoint.trust import check_loadable
from torchrig.config.resolve import Schema
from torchrig.distributed.collectives import Collectives
from torchrig.logging import get_logger
from torchrig.resilience import run_status

logger = get_logger(__name__)

#: Rank-0 phases that other ranks pass while they wait for the commit (see ``faults``).
_COMMIT_PHASES = ("before_manifest", "before_rename", "before_latest", "before_rotation_delete")
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


class CheckpointManager:
    """Saves and loads what a :class:`~torchrig.checkpoint.ledger.CheckpointLedger` lists; it
    never sees the Accelerator."""

    def __init__(self, ledger: CheckpointLedger) -> None:
        self.ledger = ledger
        self.iteration = int(self._project.iteration)
        self._strategy_sections: tuple[int, list[str]] | None = None  # (plugin generation, sections)
        self.save_pre_hooks: collections.OrderedDict[int, Callable[..., Any]] = collections.OrderedDict()
        self.load_pre_hooks: collections.OrderedDict[int, Callable[..., Any]] = collections.OrderedDict()
        self._pending: PendingSave | None = None
        #: CPU buffers reused by asynchronous saves (free only once the previous save finished).
        self._staging: dict[str, Any] = {}
        self._group: Any = None
        self._group_made = False
        #: The checkpoint this run resumed from (``load``), if any: a resumed run may replace its own later ones.
        self.resumed_from: str | None = None

    # -- where -----------------------------------------------------------------------------

    @property
    def _project(self) -> Any:
        return self.ledger.run.config.section("project_config")  # type: ignore[attr-defined]

    @property
    def custom_objects(self) -> list[Any]:
        return self.ledger.custom_objects

    def checkpoints_root(self, output_dir: str | os.PathLike[str] | None = None) -> str:
        if output_dir is not None:
            return os.path.abspath(os.fspath(output_dir))
        project_dir = self._project.project_dir
        if not project_dir:
            raise CheckpointError("automatic checkpoint naming needs a project directory: pass "
                                  "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
        return os.path.abspath(os.path.join(project_dir, "checkpoints"))

    def _target(self, output_dir: str | os.PathLike[str] | None) -> tuple[str, str | None]:
        """``(checkpoint directory, checkpoints root when automatically named)``."""
        if self._project.automatic_checkpoint_naming:
            root = self.checkpoints_root(output_dir)
            return os.path.join(root, f"{layout.AUTOMATIC_PREFIX}{self.iteration}"), root
        if output_dir is None:
            raise CheckpointError("save_state() needs an output directory: pass save_state(output_dir) or enable "
                                  "ProjectConfiguration(automatic_checkpoint_naming=True) with a project_dir")
        return os.path.abspath(os.fspath(output_dir)), None

    def latest(self, root: str | os.PathLike[str] | None = None, *, skip_damaged: bool = False) -> str | None:
        """The newest committed checkpoint under ``root`` (default: the project's checkpoints); a
        damaged newer one is an error unless ``skip_damaged``."""
        return layout.latest_checkpoint(self.checkpoints_root(root), skip_damaged=skip_damaged)

    # -- collectives -------------------------------------------------------------------------

    def _collectives(self) -> Collectives:
        """Collectives on a gloo group of its own: CPU objects under any backend, and safe to use
        from the background thread while training uses the default group."""
        world = self.ledger.run.cluster.world_size
        if world > 1 and not self._group_made:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._group_made = True
        return Collectives(world, group=self._group)

    # -- save -----------------------------------------------------------------------------

    def save(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, *,
             overwrite: bool = False, async_save: bool | None = None, hashes: bool | None = None) -> str:
        """Save everything; returns the checkpoint directory (committed when this returns,
        unless ``async_save``: then committed in the background)."""
        self.wait()
        run = self.ledger.run
        rank = run.cluster.rank
        project = self._project
        async_save = project.async_save if async_save is None else bool(async_save)
        hashes = project.checkpoint_hashes if hashes is None else bool(hashes)
        if project.save_on_each_node and run.cluster.num_nodes > 1:
            raise CheckpointError("save_state() commits one checkpoint that every node reads, so it needs a directory "
                                  "all nodes share; save_on_each_node applies to save() and save_model() only — put "
                                  "project_dir on a shared filesystem")
        target, root = self._target(output_dir)
        collectives = self._collectives()

        decision: dict[str, Any] = {}
        if rank == 0:
            decision = self._prepare_target(target, root, overwrite)
        decision = collectives.broadcast_object_list([decision])[0]
        if "error" in decision:
            raise CheckpointError(decision["error"])
        if decision.get("replaces"):
            overwrite = True  # a checkpoint this resumed run re-creates (see _resumed_run_recreates)
            if rank == 0:
                logger.warning(decision["replaces"])
        target, temporary = decision["target"], decision["temporary"]
        if root is not None:  # taken even if the save fails: numbers are never reused (as with async saves)
            self.iteration = decision["number"] + 1
        os.makedirs(temporary, exist_ok=True)

        writer = CheckpointWriter(temporary, rank, hashing=hashes, safe_serialization=safe_serialization,
                                  deferred=async_save, staging=self._staging,
                                  background_group=self._group if async_save else None)
        extra_files: list[str] = []
        local_error: str | None = None
        base: dict[str, Any] = {}
        try:  # nothing may skip the agreement below, or the other ranks would wait for this one
            base = self._manifest_base(decision.get("number"), hashes)
            extra_files = self._write_state(writer)
        except _PASS_THROUGH:
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            local_error = describe(exc)

        def finish() -> str:
            return self._finish(collectives, writer, extra_files, local_error, temporary, target, root, base, overwrite)

        if async_save:
            self._pending = PendingSave(target, finish, describe)
            return target
        return finish()

    def _prepare_target(self, target: str, root: str | None, overwrite: bool) -> dict[str, Any]:
        """Rank 0: reclaim what dead writers left, check the target, claim its temporary directory.

        An automatically named target takes the next number after every one already taken in the
        root (:func:`~torchrig.checkpoint.layout.highest_taken_number`: a damaged checkpoint kept as
        evidence, a directory renamed by hand, a committed checkpoint under another name), so it
        never collides with what is there.
        """
        parent = os.path.dirname(target)
        number = None
        replaces: str | None = None
        try:
            os.makedirs(parent, exist_ok=True)
            layout.remove_leftovers(parent)
            if root is not None:
                taken = layout.highest_taken_number(root)
                number = self.iteration if taken is None else max(self.iteration, taken + 1)
                target = os.path.join(root, f"{layout.AUTOMATIC_PREFIX}{number}")
                while os.path.lexists(target) and not layout.is_committed(target):
                    number += 1
                    target = os.path.join(root, f"{layout.AUTOMATIC_PREFIX}{number}")
            if os.path.exists(target):
                if not layout.is_committed(target):
                    return {"error": f"cannot save to {target}: it exists and is not a committed torchrig checkpoint "
                                     "(it has no valid manifest); choose another directory or remove it"}
                replaces = None if overwrite else self._resumed_run_recreates(target)
                if not (overwrite or replaces):
                    return {"error": f"cannot save to {target}: a committed checkpoint is already there; pass "
                                     "save_state(..., overwrite=True) to replace it atomically, or choose another "
                                     "directory"}
            temporary = temporaries.claim(target, "tmp")
            try:
                os.makedirs(temporary)
            except BaseException:
                temporaries.release(temporary)
                raise
        except OSError as exc:
            return {"error": f"cannot create a checkpoint in {parent}: {exc.strerror or exc}"}
        return {"target": target, "temporary": temporary, "number": number, "replaces": replaces}

    def _resumed_run_recreates(self, target: str) -> str | None:
        """Why ``target``, a committed checkpoint, may be replaced without ``overwrite``: this run resumed
        (``load_state``) and ``target`` was written by the same run — same configuration and data order —
        so saving there re-creates it, as a script resumed with its ``--output_dir`` does (Accelerate
        overwrites). None when it may not: no resume, or another run's checkpoint."""
        if self.resumed_from is None:
            return None
        existing = read_manifest(target) or {}
        config_keys, data_order = self._fingerprint()
        ours = {"config_hash": digest(config_keys), "data_order_hash": digest(data_order)}
        theirs = existing.get("fingerprint") or {}
        if any(theirs.get(key) != value for key, value in ours.items()):
            return None
        if existing.get("world_size") != self.ledger.run.cluster.world_size:
            return None
        return (f"replacing {target}: a checkpoint of this same run (same configuration and data order) that the "
                f"run resumed from {self.resumed_from} saves again")

    def _write_state(self, writer: CheckpointWriter) -> list[str]:
        """Write this rank's files; returns the files a library wrote without the writer."""
        ledger = self.ledger
        run, host = ledger.run, ledger.host
        rank = run.cluster.rank
        main = run.cluster.is_main_process
        prepared = self._models_for_save(writer.directory)
        faults.point("before_model", rank)
        written = host.hook.torchrig_save_strategy_state(run=run, prepared=prepared, directory=writer.directory,
                                                         writer=writer) or []
        faults.point("mid_optimizer", rank)  # ranks that wrote no optimizer file pass it here
        if main:
            for index, scheduler in enumerate(ledger.schedulers):
                _save_checked(writer, scheduler.state_dict(), layout.numbered("scheduler", index, ".bin"),
                              f"scheduler {index}")
            for index, loader in enumerate(ledger.dataloaders):
                if hasattr(loader, "state_dict"):
                    _save_checked(writer, loader.state_dict(), layout.numbered("dl_state_dict", index, ".bin"),
                                  f"dataloader {index}")
            for name, obj in self._plugin_state().items():
                _save_checked(writer, obj.state_dict(), f"{name}.pt", f"plugin state {name!r}")
            for index, obj in enumerate(ledger.custom_objects):
                # safetensors + a JSON skeleton (no pickle); a restricted-pickle .bin if it holds more
                save_structured(writer, obj.state_dict(), f"custom_checkpoint_{index}",
                                what=f"registered object {index} ({type(obj).__name__})")
        writer.save_torch(capture_rng(), f"random_states_{rank}.pkl")
        return list(written)

    def _models_for_save(self, directory: str) -> list[Any]:
        """The prepared models the save pre-hooks kept (a hook removes a model, or its weights,
        from the lists it is given to save that model itself)."""
        prepared = list(self.ledger.models)
        if not self.save_pre_hooks:
            return prepared
        models = [item.model for item in prepared]
        weights = [item.unwrapped.state_dict() for item in prepared]
        kept_models, kept_weights = list(models), list(weights)
        for hook in self.save_pre_hooks.values():
            hook(kept_models, kept_weights, directory)
        return [item for item, model, state in zip(prepared, models, weights)
                if any(m is model for m in kept_models) and any(w is state for w in kept_weights)]

    def _plugin_state(self) -> dict[str, Any]:
        """Objects plugins want checkpointed (``torchrig_checkpoint_state``), by file name."""
        state: dict[str, Any] = {}
        for contribution in self.ledger.host.hook.torchrig_checkpoint_state(run=self.ledger.run):
            for name, obj in (contribution or {}).items():
                if name in state:
                    raise CheckpointError(f"two plugins contribute checkpoint state named {name!r}")
                state[name] = obj
        return state

    def _manifest_base(self, number: int | None, hashes: bool) -> dict[str, Any]:
        """The manifest but its files and ``sequence`` (given at the commit, in commit order)."""
        import torch

        ledger = self.ledger
        run = ledger.run
        config_keys, data_order = self._fingerprint()
        return {
            "format": layout.FORMAT, "format_version": layout.FORMAT_VERSION, "iteration": number,
            "accumulation_step": ledger.gradient_state.step,
            "created_at": time.time(), "world_size": run.cluster.world_size, "num_nodes": run.cluster.num_nodes,
            "strategy": run.config.get("strategy"), "layout": topology.current(run), "hashes": hashes,
            "versions": {"torchrig": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "fingerprint": {"config_hash": digest(config_keys), "data_order_hash": digest(data_order),
                            "config": config_keys, "data_order": data_order},
            "contents": {"models": len(ledger.models), "optimizers": len(ledger.optimizers),
                         "schedulers": len(ledger.schedulers),
                         "dataloaders": len(ledger.dataloaders), "custom_objects": len(ledger.custom_objects)},
        }

    def _fingerprint(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        config: Any = self.ledger.run.config
        owner = f"strategy:{config.get('strategy')}"
        host = self.ledger.host
        if self._strategy_sections is None or self._strategy_sections[0] != host.generation:
            # The schema reads every section's type hints (~5 ms); it changes only with the plugins.
            self._strategy_sections = (host.generation, [key for key, by in Schema(host).section_owner.items()
                                                          if by == owner])
        sections = self._strategy_sections[1]
        return fingerprint_config(config.items(), sections), [describe_dataloader(d) for d in self.ledger.dataloaders]

    def _finish(self, collectives: Collectives, writer: CheckpointWriter, extra_files: list[str],
                local_error: str | None, temporary: str, target: str, root: str | None, base: dict[str, Any],
                overwrite: bool) -> str:
        rank = self.ledger.run.cluster.rank
        records: list[FileRecord] = []
        if local_error is None:
            try:
                writer.flush()
                records = writer.records(extra_files)
                if rank != 0:  # rank 0 fsyncs the directory after writing the manifest into it
                    fsync_path(temporary)
            except _PASS_THROUGH:
                raise
            except BaseException as exc:
                local_error = describe(exc)
        report = {"rank": rank, "error": local_error, "files": [r.to_json() for r in records]}
        reports = collectives.gather_object(report)
        failures = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
        outcome: dict[str, Any] = {}
        if rank == 0:
            if failures:
                temporaries.remove(temporary)
                outcome = {"error": f"checkpoint {target} was not saved, the previous checkpoint is intact ("
                                    + "; ".join(failures) + ")"}
            else:
                outcome = self._commit(reports, temporary, target, root, base, overwrite)
        else:
            for phase in _COMMIT_PHASES:
                faults.point(phase, rank)
        outcome = collectives.broadcast_object_list([outcome])[0]
        if "error" in outcome:
            raise CheckpointError(outcome["error"])
        run_status.record(last_checkpoint=target)  # every rank's status file names it
        for message in outcome.get("warnings", []):
            logger.warning(message)
        return target

    def _commit(self, reports: Sequence[Mapping[str, Any]], temporary: str, target: str, root: str | None,
                base: dict[str, Any], overwrite: bool) -> dict[str, Any]:
        """Rank 0: manifest, rename, ``latest``, rotation. Returns the outcome to broadcast.

        The manifest is written only after every file in the temporary directory — the ranks'
        and any a save pre-hook wrote itself — was checked on disk (a regular file of the size
        recorded): a checkpoint whose manifest does not match its files is never published.
        """
        files = {entry["path"]: entry for report in reports for entry in report["files"]}
        try:
            faults.point("before_manifest", 0)
            for relative in layout.unlisted_files(temporary, set(files)):  # files a save pre-hook wrote itself
                path = os.path.join(temporary, relative)
                fsync_path(path)
                files[relative] = FileRecord(relative, os.path.getsize(path),
                                             hash_file(path) if base["hashes"] else None, 0).to_json()
            problems = [p for p in (layout.check_file(temporary, name, entry["size"]) for name, entry in files.items())
                        if p is not None]
            if problems:
                temporaries.remove(temporary)
                return {"error": f"checkpoint {target} was not committed, the previous checkpoint is intact: its files "
                                 f"changed after they were written ({'; '.join(problems[:5])}) — is another process "
                                 "writing into the same checkpoint directory?"}
            sequence = 1 + max((seq for seq, _, _ in layout.committed_checkpoints(os.path.dirname(target))), default=0)
            manifest = {**base, "sequence": sequence, "files": [files[name] for name in sorted(files)],
                        "committed_at": time.time()}
            layout.write_manifest(temporary, manifest)
            faults.point("before_rename", 0)
            if overwrite and os.path.exists(target):
                layout.replace_directory(temporary, target)
            else:
                os.rename(temporary, target)
                temporaries.release(temporary)
                fsync_path(os.path.dirname(target))
        except OSError as exc:
            temporaries.remove(temporary)
            return {"error": f"checkpoint {target} was not committed, the previous checkpoint is intact: "
                             f"{describe_os_error(exc, exc.filename or temporary)}"}
        warnings: list[str] = []
        faults.point("before_latest", 0)
        if root is not None:
            try:
                # Not fsynced: loading goes by the manifests' sequence numbers, never by `latest`
                # (a pointer for people), so a power loss that rolls it back loses nothing.
                layout.write_text_atomic(os.path.join(root, layout.LATEST_NAME), os.path.basename(target) + "\n",
                                         durable=False)
            except OSError as exc:
                warnings.append(f"checkpoint {target} is committed but {root}/latest was not updated: {exc}")
            faults.point("before_rotation_delete", 0)
            warnings.extend(self._rotate(root, keep=target))
        self._notify_committed(target, manifest)
        return {"path": target, "warnings": warnings}

    def _rotate(self, root: str, keep: str) -> list[str]:
        limit = self._project.total_limit
        if not limit:
            return []
        # Only automatically named checkpoints rotate: others in the folder belong to someone else.
        committed = [path for _, path, _ in layout.committed_checkpoints(root)
                     if os.path.abspath(path) != keep and layout.automatic_number(os.path.basename(path)) is not None]
        excess = len(committed) + 1 - limit
        warnings = []
        for path in committed[:max(0, excess)]:
            try:
                layout.delete_checkpoint(path)
            except OSError as exc:
                warnings.append(f"could not delete old checkpoint {path} (total_limit={limit}): {exc}")
        return warnings

    def _notify_committed(self, target: str, manifest: Mapping[str, Any]) -> None:
        self.ledger.host.hook.torchrig_checkpoint_committed(run=self.ledger.run, directory=target, manifest=manifest)

    # -- waiting on an asynchronous save ------------------------------------------------------

    def wait(self) -> None:
        """Wait for a background save; raise its error (on every rank: the outcome is shared)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.join()
        message = pending.failure()
        if message is not None:
            # The iteration number stays used: numbering never goes back after a failed save.
            raise CheckpointError(message) from pending.error

    # -- load -----------------------------------------------------------------------------

    def load(self, input_dir: str | os.PathLike[str] | None = None, *, allow_config_change: bool | None = None,
             allow_world_size_change: bool | None = None, verify_hashes: bool | None = None,
             allow_pickle: bool = False, skip_damaged: bool = False) -> str:
        """Load a committed checkpoint (default: the project's latest); returns its directory
        (see :mod:`torchrig.checkpoint.loading`). ``allow_*=None``: the project configuration's
        value, so a script that cannot pass them (transformers' no_trainer scripts) is set from
        its config file, flags or environment."""
        self.wait()
        project = self._project
        if allow_config_change is None:
            allow_config_change = project.allow_config_change
        if allow_world_size_change is None:
            allow_world_size_change = project.allow_world_size_change
        loaded = loading.load(self, input_dir, allow_config_change=allow_config_change,
                              allow_world_size_change=allow_world_size_change, verify_hashes=verify_hashes,
                              allow_pickle=allow_pickle, skip_damaged=skip_damaged)
        self.resumed_from = loaded
        return loaded


def _save_checked(writer: CheckpointWriter, state: Any, name: str, what: str) -> None:
    """``torch.save`` ``state`` once it is known that ``load_state`` can read it back."""
    check_loadable(state, what)
    writer.save_torch(state, name)


__all__ = ["CheckpointManager"]
