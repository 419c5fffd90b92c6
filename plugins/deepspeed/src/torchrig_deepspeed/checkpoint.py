"""DeepSpeed engine checkpoints inside the core's checkpoint directory, and full-weight export.

Each engine saves with ``engine.save_checkpoint(directory, tag=…, save_latest=False)`` into the
core's temporary directory: model ``i`` under the tag ``pytorch_model`` (``pytorch_model_<i>``
after the first, Accelerate's names), so its files are ``<tag>/mp_rank_00_model_states.pt`` (the
model, and at stage 0 in fp32 the optimizer), ``<tag>/*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
(each rank's optimizer partition under ZeRO and DeepSpeed's bf16 optimizer),
``<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (ZeRO-3's per-rank parameters), plus DeepSpeed's
recovery scripts ``zero_to_fp32.py``/``zero_to_torch.py`` next to the tags. Every rank writes its
own files; the hook returns exactly those (recorded from DeepSpeed's checkpoint engine), and the
core fsyncs, sizes, manifests and commits them.

DeepSpeed's engine reads its files with ``torch.load(weights_only=False)``, which runs any code a
planted checkpoint holds. While torchrig loads, the engine's checkpoint engine is replaced by
one that reads with ``weights_only=True`` and allows only the DeepSpeed types its checkpoints
hold (:data:`SAFE_GLOBALS`); ``load_state(..., allow_pickle=True)`` gives DeepSpeed's own full
unpickling back, for checkpoints the user trusts (docs/deepspeed.md).

The module state DeepSpeed reads back goes through the core's module load (non-strict, then every
missing/unexpected key checked, :func:`_load_module`) rather than DeepSpeed's strict one.

DeepSpeed's ``latest`` file is never written and never read: the tag is always passed, and what
is committed is decided by the core's manifest. ``load_checkpoint`` is asked for the tag and its
``None`` ("nothing loaded", which DeepSpeed only logs) is an error here.

A checkpoint whose optimizer state is partitioned per rank loads only at the world size it was
saved with; another world size is an error pointing at DeepSpeed's universal checkpoint
conversion (``ds_to_universal``).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchrig.plugin import PICKLE_OPT_IN, RunContext, describe_layout, load_model_state, run_layout, saved_layout

if TYPE_CHECKING:  # pragma: no cover
    from torchrig_deepspeed.strategy import EngineRecord

#: Accelerate's tag of the first model's engine checkpoint.
MODEL_TAG = "pytorch_model"
#: Scripts DeepSpeed copies next to the tags (rank 0, when optimizer state is partitioned).
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class DeepSpeedCheckpointError(RuntimeError):
    """Saving or loading DeepSpeed engine state failed; the message names the model and the fix."""


def tag_for(index: int) -> str:
    return MODEL_TAG if index == 0 else f"{MODEL_TAG}_{index}"


def _describe(record: EngineRecord) -> str:
    return f"model #{record.index} ({type(record.module).__name__}, tag {record.tag!r})"


class _Recording:
    """Stands in for the engine's checkpoint engine during a save: every ``save(state, path)`` goes
    through and ``path`` is remembered (the files this rank wrote) — or, in an asynchronous save
    (``writer.deferred``), goes to the core's writer instead, which copies the state to CPU buffers
    now and writes the file in the save's background half (the engine's collectives and the state
    it assembles stay in ``save_checkpoint``, on the caller's thread)."""

    def __init__(self, inner: Any, writer: Any) -> None:
        self._inner = inner
        self._writer = writer
        self.paths: list[str] = []

    def save(self, state_dict: Any, path: str) -> Any:
        if self._writer is not None and self._writer.deferred:
            self._writer.save_torch(state_dict, os.path.relpath(os.fspath(path), self._writer.directory))
            return None
        result = self._inner.save(state_dict, path)
        self.paths.append(os.fspath(path))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def safe_globals() -> list[Any]:
    """The non-torch types DeepSpeed engine checkpoints hold (loss scalers, enums, config
    objects): plain data classes whose unpickling calls no code of the checkpoint's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class _SafeLoading:
    """Stands in for the engine's checkpoint engine during a load: every ``load(path)`` reads
    with ``weights_only=True`` and :func:`safe_globals` (unless ``allow_pickle``)."""

    def __init__(self, inner: Any, allow_pickle: bool) -> None:
        self._inner = inner
        self._allow_pickle = allow_pickle

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch

        if self._allow_pickle:
            return self._inner.load(path, map_location=map_location)
        try:
            with torch.serialization.safe_globals(safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            reason = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), type(exc).__name__)
            raise DeepSpeedCheckpointError(f"deepspeed: {path} holds objects the safe loader refuses ({reason}); "
                                           f"{PICKLE_OPT_IN}") from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def save_state(run: RunContext, records: Sequence[EngineRecord], directory: str, writer: Any = None) -> list[str]:
    """Every engine's checkpoint under its tag in ``directory``; the paths (relative to
    ``directory``) of the files this rank wrote itself (an asynchronous save hands the engine's
    files to ``writer``, which records them)."""
    written: list[str] = []
    for record in records:
        engine = record.engine
        checkpoint_engine = engine.checkpoint_engine
        if checkpoint_engine.is_decoupled():
            raise DeepSpeedCheckpointError(
                f"deepspeed: {_describe(record)} uses a decoupled checkpoint engine, which writes after save_checkpoint "
                "returns; torchrig commits a checkpoint only once every file is written. Remove the decoupled "
                "checkpoint writer from the DeepSpeed config's 'checkpoint' block")
        recording = _Recording(checkpoint_engine, writer)
        engine.checkpoint_engine = recording
        try:
            engine.save_checkpoint(directory, tag=record.tag, save_latest=False)
        except Exception as exc:
            raise DeepSpeedCheckpointError(f"deepspeed: saving {_describe(record)} into {directory} failed: "
                                           f"{type(exc).__name__}: {exc}") from exc
        finally:
            engine.checkpoint_engine = checkpoint_engine
        written.extend(recording.paths)
        offloaded = os.path.join(directory, record.tag, "offloaded_tensors")
        if engine.zero_nvme_offload_optimizer() and os.path.isdir(offloaded):  # DeepSpeed copies its swap files
            rank_dir = os.path.join(offloaded, f"rank{engine.local_rank if engine.use_node_local_storage() else engine.global_rank}")
            for root, _, names in os.walk(rank_dir):
                written.extend(os.path.join(root, name) for name in names)
    if run.cluster.is_main_process:
        written.extend(os.path.join(directory, name) for name in RECOVERY_SCRIPTS
                       if os.path.isfile(os.path.join(directory, name)))
    relative = [os.path.relpath(path, directory).replace(os.sep, "/") for path in written]
    return sorted(set(relative))


def _partitioned(record: EngineRecord) -> bool:
    """Whether this engine writes optimizer state per rank (ZeRO 1-3, DeepSpeed's bf16 optimizer)."""
    engine = record.engine
    return bool(engine.zero_optimization() or hasattr(engine.optimizer, "dp_process_group"))


def _load_module(src: Mapping[str, Any], dst: Any) -> None:
    """The module half of ``engine.load_checkpoint``: the core's check instead of DeepSpeed's strict
    ``load_state_dict``, which refuses the keys a module writes into ``state_dict()`` but never reads
    back (bitsandbytes' 4-bit quantization state, ``weight.absmax``/``quant_map``/``quant_state.*``,
    under QLoRA). Such a key passes when it equals the live value; any other missing or unexpected
    key is still an error naming it."""
    load_model_state(dst, src)


def load_state(run: RunContext, records: Sequence[EngineRecord], directory: str, manifest: Mapping[str, Any],
               allow_pickle: bool = False) -> None:
    """Load every engine's checkpoint from its tag (collective), unpickling only safe types unless
    ``allow_pickle``."""
    saved_world = int(manifest.get("world_size", run.cluster.world_size))
    world = run.cluster.world_size
    strategy = manifest.get("strategy")
    for record in records:
        path = os.path.join(directory, record.tag)
        if not os.path.isdir(path):
            saved = describe_layout(saved_layout(manifest))  # "fsdp on 2 processes", or a mesh's axes
            by = saved if saved.startswith(f"{strategy} ") else f"{strategy!r} under {saved}"
            raise DeepSpeedCheckpointError(
                f"deepspeed: {directory} holds no DeepSpeed engine state for {_describe(record)} (no {record.tag}/): it "
                f"was saved by {by}" + (" with fewer models" if strategy == "deepspeed" else "")
                + f"; this run is {describe_layout(run_layout(run))}. DeepSpeed engines load only their own engine state: "
                "load it with the strategy and models it was saved with")
        if saved_world != world and _partitioned(record):
            raise DeepSpeedCheckpointError(
                f"deepspeed: {directory} was saved by {saved_world} processes and this run has {world}: the optimizer "
                f"state of {_describe(record)} is partitioned per rank (ZeRO stage {record.engine.zero_optimization_stage()}"
                f"), so it loads only at {saved_world} processes. To change the world size, convert it with DeepSpeed's "
                f"universal checkpoint: `python -m deepspeed.checkpoint.ds_to_universal --input_folder {path} "
                f"--output_folder {path}_universal`, then load that with `\"checkpoint\": {{\"load_universal\": true}}` "
                "in the DeepSpeed config through engine.load_checkpoint")
        engine = record.engine
        checkpoint_engine = engine.checkpoint_engine
        engine.checkpoint_engine = _SafeLoading(checkpoint_engine, allow_pickle)
        try:
            load_path, _ = engine.load_checkpoint(directory, tag=record.tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True, custom_load_fn=_load_module)
        except DeepSpeedCheckpointError:
            raise
        except Exception as exc:
            raise DeepSpeedCheckpointError(f"deepspeed: loading {_describe(record)} from {path} failed: "
                                           f"{type(exc).__name__}: {exc}") from exc
        finally:
            engine.checkpoint_engine = checkpoint_engine
        if load_path is None:  # DeepSpeed only logs this and carries on with the current weights
            raise DeepSpeedCheckpointError(f"deepspeed: DeepSpeed loaded nothing for {_describe(record)} from {path} "
                                           "(its model states file is missing or unreadable)")


def full_state_dict(run: RunContext, record: EngineRecord) -> dict[str, Any]:
    """The model's full state dict, on the main process: under ZeRO-3 every parameter is gathered
    from the ranks' partitions, layer by layer (collective; the other ranks get ``{}``), with the
    values the model computes with (bf16/fp16 when the engine trains in them). Other stages hold
    whole parameters on every rank."""
    engine = record.engine
    if engine.zero_optimization_partition_weights():
        state = engine._zero3_consolidated_16bit_state_dict()
        return dict(state) if state is not None else {}
    return engine.module.state_dict()


__all__ = ["MODEL_TAG", "DeepSpeedCheckpointError", "full_state_dict", "load_state", "safe_globals", "save_state",
           "tag_for"]
