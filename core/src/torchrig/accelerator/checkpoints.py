"""The Accelerator's checkpoint calls (``save_state``, ``load_state``, registration, ``save_model``,
``save``): thin over :class:`~torchrig.checkpoint.manager.CheckpointManager`, which owns the commit
protocol (docs/checkpoints.md); here are only the Accelerate-shaped signatures and who writes files.

The manager and the writers (:mod:`torchrig.checkpoint.manager`, :mod:`torchrig.checkpoint.export`:
loading, state dicts, safetensors) are imported by the first checkpoint call, not by every
``Accelerator()``: a run that never saves does not pay for them at start-up (benchmark B12).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from torchrig.checkpoint.ledger import CheckpointLedger
from torchrig.config.resolve import ResolvedConfig

if TYPE_CHECKING:
    from torchrig.checkpoint.manager import CheckpointManager


class CheckpointCalls:
    """Checkpoints of an :class:`~torchrig.Accelerator` (its ledger of prepared objects and its manager)."""

    _ledger: CheckpointLedger
    #: Made by the first checkpoint call (:attr:`_checkpoints`); None until then.
    _checkpoint_manager: CheckpointManager | None = None
    config: ResolvedConfig
    is_main_process: bool
    is_local_main_process: bool

    if TYPE_CHECKING:  # the Accelerator's own (declared here for type checkers only: no stub may shadow them)
        def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, Any]: ...

        def wait_for_everyone(self) -> None: ...

        def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any: ...

    @property
    def _checkpoints(self) -> CheckpointManager:
        """The run's checkpoint manager, made on first use."""
        if self._checkpoint_manager is None:
            # Deliberately deferred for start-up cost (see the module docstring).
            from torchrig.checkpoint.manager import CheckpointManager

            self._checkpoint_manager = CheckpointManager(self._ledger)
        return self._checkpoint_manager

    def _wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save to commit and raise its failure (none without a manager)."""
        if self._checkpoint_manager is not None:
            self._checkpoint_manager.wait()

    @property
    def save_iteration(self) -> int:
        """Number of the next automatically named checkpoint (restored by ``load_state``)."""
        return self._checkpoints.iteration

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   overwrite: bool = False, async_save: bool | None = None, hashes: bool | None = None) -> str:
        """Save models, optimizers, schedulers, scaler, dataloader positions, RNG of every rank,
        counters and registered objects as one committed checkpoint; returns its directory.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it is
        ``<project_dir>/checkpoints/checkpoint_<iteration>`` (``output_dir``, if given, replaces
        the ``checkpoints`` root) and ``total_limit`` old ones are deleted after the commit.
        ``async_save`` (default ``ProjectConfiguration.async_save``) returns after the copy to
        CPU memory; ``hashes`` (default ``checkpoint_hashes``) records sha256 of every file.
        """
        return self._checkpoints.save(output_dir, safe_serialization, overwrite=overwrite, async_save=async_save,
                                      hashes=hashes)

    def load_state(self, input_dir: str | os.PathLike | None = None, *, allow_config_change: bool | None = None,
                   allow_world_size_change: bool | None = None, verify_hashes: bool | None = None,
                   allow_pickle: bool = False, skip_damaged: bool = False, **_accelerate: Any) -> str:
        """Load a committed checkpoint — by default the project's newest — into everything
        prepared and registered; returns its directory. Never starts fresh silently: no
        checkpoint, a damaged one, or a changed configuration or world size is an error, unless
        ``allow_config_change``/``allow_world_size_change`` (default: ``project_config``'s keys of
        the same names, off) say to load it anyway.
        ``skip_damaged`` resumes from the newest intact checkpoint past damaged newer ones;
        ``verify_hashes`` (default: whenever the checkpoint recorded hashes) checks every file's
        sha256 before anything is loaded; ``allow_pickle`` unpickles files the safe loader refuses —
        it can run code from the checkpoint, so only for checkpoints you trust (docs/checkpoints.md,
        trust model)."""
        if _accelerate:  # Accelerate's load_model_func_kwargs go to its own model loader
            raise TypeError(f"load_state(): unsupported arguments {sorted(_accelerate)}")
        return self._checkpoints.load(input_dir, allow_config_change=allow_config_change,
                                      allow_world_size_change=allow_world_size_change, verify_hashes=verify_hashes,
                                      allow_pickle=allow_pickle, skip_damaged=skip_damaged)

    def latest_checkpoint(self, root: str | os.PathLike | None = None, *, skip_damaged: bool = False) -> str | None:
        """The newest committed checkpoint (default: under ``<project_dir>/checkpoints``), or
        None — to resume when there is one and start fresh otherwise. A damaged newer one is an
        error naming it unless ``skip_damaged``."""
        return self._checkpoints.latest(root, skip_damaged=skip_damaged)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (each with ``state_dict``/``load_state_dict``) with every checkpoint."""
        invalid = [f"#{i} ({type(o).__name__})" for i, o in enumerate(objects)
                   if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if invalid:
            raise ValueError(f"register_for_checkpointing: {', '.join(invalid)} lack state_dict()/load_state_dict()")
        self._ledger.custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(models, weights, output_dir)`` runs before a save; removing a model (or its
        weights) from the lists saves that model by the hook alone. Returns a removable handle."""
        handle = RemovableHandle(self._checkpoints.save_pre_hooks)
        self._checkpoints.save_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(models, input_dir)`` runs before a load; removing a model skips loading it."""
        handle = RemovableHandle(self._checkpoints.load_pre_hooks)
        self._checkpoints.load_pre_hooks[handle.id] = hook
        return handle

    def save_model(self, model: Any, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> list[str]:
        """What ``from_pretrained`` reads, from any layout (collective): the full weights (gathered
        from shards) as ``model.safetensors`` or shards with an index, under transformers' names
        (wrapper segments removed, tied weights once), with ``config.json`` when the model has a
        config; a peft model's adapters alone (``adapter_model.safetensors`` +
        ``adapter_config.json``). Where every tensor is a DTensor on every rank (FSDP2, TP, FSDP2×TP)
        the ranks write the files in parallel (:mod:`torchrig.checkpoint.parallel_export`). Returns
        every file written on the main process, ``[]`` on the others."""
        # Deliberately deferred for start-up cost (see the module docstring).
        from torchrig.checkpoint.export import parse_size, save_pretrained_files
        from torchrig.checkpoint.hf_names import is_peft_model
        from torchrig.checkpoint.parallel_export import parallel_state, save_in_parallel, written_by_all

        parse_size(max_shard_size)  # a bad size fails on every rank, before any gathering
        unwrapped = self.unwrap_model(model)
        directory = os.fspath(save_directory)
        if safe_serialization and not is_peft_model(unwrapped) and not self.config["project_config.save_on_each_node"]:
            sharded = parallel_state(unwrapped)  # every rank writes its part where the layout allows it
            if sharded is not None:
                written = written_by_all(save_in_parallel(unwrapped, sharded, directory, max_shard_size))
                self.wait_for_everyone()
                return written
        state = self.get_state_dict(model)
        written = save_pretrained_files(unwrapped, state, directory, max_shard_size,
                                        safe_serialization) if self._writes_files else []
        self.wait_for_everyone()
        return written

    def load_pretrained_weights(self, model: Any, path: str | os.PathLike, strict: bool = True) -> Any:
        """Load Hugging Face safetensors weights (a directory with ``model.safetensors`` or
        ``model.safetensors.index.json``, or one file) into ``model`` in place, before or after
        ``prepare``, in any layout (collective when sharded): each rank reads only its own shards'
        bytes, converting to the parameters' dtype. Missing/unexpected keys (transformers' names)
        are an error naming them unless ``strict=False``. Returns what was read
        (:class:`~torchrig.checkpoint.hf_load.PretrainedLoad`)."""
        # Deliberately deferred for start-up cost (see the module docstring).
        from torchrig.checkpoint.hf_load import load_pretrained_weights

        return load_pretrained_weights(self.unwrap_model(model), path, strict)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` once per job (once per node with ``save_on_each_node``), atomically."""
        # Deliberately deferred for start-up cost (see the module docstring).
        from torchrig.checkpoint.export import save_object

        if self._writes_files:
            save_object(obj, os.fspath(f), safe_serialization)

    @property
    def _writes_files(self) -> bool:
        """Whether this process writes ``save``/``save_model`` files: the main process, or each
        node's local main process with ``save_on_each_node``."""
        return self.is_main_process or (self.config["project_config.save_on_each_node"] and self.is_local_main_process)


__all__ = ["CheckpointCalls"]
