"""FSDP checkpoint state inside the core's checkpoint directory, and full-weight export.

Files, named as Accelerate names them so its users recognise them (``i``: the model's index in
``prepare`` order, ``k``: the optimizer's index over all models):

* ``state_dict_type: SHARDED_STATE_DICT`` — ``pytorch_model_fsdp_<i>/`` and ``optimizer_<k>/``,
  each a ``torch.distributed.checkpoint`` (DCP) directory: every rank writes its shards
  (``__<rank>_0.distcp``), rank 0 the ``.metadata``. Loading reshards, so a checkpoint saved on
  2 processes loads on 1 and the other way round.
* ``state_dict_type: FULL_STATE_DICT`` — ``pytorch_model_fsdp.bin`` (``_<i>.bin`` after the first)
  and ``optimizer.bin`` (``optimizer_<k>.bin``): full, parameter-name-keyed state dicts gathered
  on rank 0 and written by it (``torch.save``); loading broadcasts them from rank 0.

Loading reads whichever format the checkpoint holds, whatever ``state_dict_type`` says now, and
under whatever mesh this run has (keys are parameter names, the same in every layout: DCP
reshards); a single-process or DDP checkpoint (``model.safetensors``, position-keyed
``optimizer.safetensors``: :mod:`torchrig.checkpoint.plain`) is read on rank 0 and distributed.
The hooks write and read only inside the directory they are given; the commit protocol around
it (temporary directory, fsync, manifest, rename) is the core's. DCP reports failures as
``CheckpointException``, a ``BaseException``: it is caught here and raised again as
:class:`FSDPCheckpointError` (an ``Exception``) naming the model and the directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torchrig.plugin import (
    PreparedModel,
    RunContext,
    check_loadable,
    describe_layout,
    load_pickled,
    model_files,
    optimizer_by_name,
    read_model_state,
    read_optimizer_state,
    run_layout,
    saved_layout,
)

from torchrig_fsdp import safe_dcp, strided

SHARDED = "SHARDED_STATE_DICT"
FULL = "FULL_STATE_DICT"


class FSDPCheckpointError(RuntimeError):
    """Writing or reading FSDP checkpoint state failed; the message names what and where."""


def model_name(index: int, sharded: bool) -> str:
    if sharded:
        return f"pytorch_model_fsdp_{index}"
    return "pytorch_model_fsdp.bin" if index == 0 else f"pytorch_model_fsdp_{index}.bin"


def optimizer_name(index: int, sharded: bool) -> str:
    if sharded:
        return f"optimizer_{index}"
    return "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _options(**kwargs: Any) -> Any:
    return StateDictOptions(**kwargs)


def full_model_state(run: RunContext, model: torch.nn.Module, *, rank0_only: bool = True,
                     offload_to_cpu: bool = True) -> dict[str, Any]:
    """The unsharded state dict (collective): on rank 0 only (other ranks get ``{}``) unless
    ``rank0_only`` is False; on the CPU unless ``offload_to_cpu`` is False."""
    if not _distributed() or run.cluster.world_size <= 1:
        state = model.state_dict()
        return {k: v.detach().cpu() for k, v in state.items()} if offload_to_cpu else state
    state = get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=rank0_only))
    if offload_to_cpu and not rank0_only:
        state = {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
    return state


# -- save ---------------------------------------------------------------------------------------


def save_state(run: RunContext, prepared: Sequence[PreparedModel], state_dict_type: str, writer: Any) -> list[str]:
    """Write every prepared model's and optimizer's state into ``writer.directory`` through ``writer`` (the
    core's :class:`~torchrig.checkpoint.files.CheckpointWriter`). Synchronous saves write now; an
    asynchronous one (``writer.deferred``) stages each DCP state dict on the CPU now and writes it in
    the save's background half (:func:`_dcp_save`), the full state dicts as CPU snapshots likewise.
    Returns the paths this rank wrote outside the writer (none: DCP's go through ``library_write``)."""
    sharded = state_dict_type != FULL
    optimizer_index = 0
    for index, item in enumerate(prepared):
        model = item.unwrapped
        if sharded:
            _dcp_save({"model": get_model_state_dict(model)}, writer, model_name(index, True), f"model {index}")
        else:
            _save_full(run, full_model_state(run, model), writer, model_name(index, False))
        for optimizer in item.optimizers:
            name = optimizer_name(optimizer_index, sharded)
            if sharded:
                state = get_optimizer_state_dict(model, optimizer)
                check_loadable(state, f"optimizer {optimizer_index}")  # DCP pickles non-tensor values
                _dcp_save({"optimizer": state}, writer, name, f"optimizer {optimizer_index}")
            else:
                options = _options(full_state_dict=True, cpu_offload=True) if _distributed() else None
                state = get_optimizer_state_dict(model, optimizer, options=options)
                if run.cluster.is_main_process:  # what torch.save writes, load_state must read back
                    check_loadable(state, f"optimizer {optimizer_index}")
                _save_full(run, state, writer, name)
            optimizer_index += 1
    return []


def _save_full(run: RunContext, state: dict[str, Any], writer: Any, name: str) -> None:
    if run.cluster.is_main_process:
        writer.save_torch(state, name)


class _Staging:
    """DCP's own stager, one per process: a CPU copy of a state dict's local shards (pinned memory
    when CUDA is there, for fast device-to-host copies), its buffers reused by the next save."""

    stager: Any = None

    @classmethod
    def stage(cls, state: dict[str, Any]) -> dict[str, Any]:
        if cls.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            cls.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                      use_async_staging=False, use_non_blocking_copy=False))
        return cls.stager.stage(state)


def _dcp_save(state: dict[str, Any], writer: Any, name: str, what: str) -> None:
    """``state`` as a DCP directory ``name``: now, or — in an asynchronous save — staged on the CPU
    now and written in the background half on the save's own gloo group. Not DCP's ``async_save``:
    each call runs on a thread of its own, so a model's and an optimizer's saves would interleave
    their collectives on one group; here the commit protocol runs them in order and waits for them
    before the ranks agree."""
    path = os.path.join(writer.directory, name)
    if os.path.isdir(path) and os.listdir(path):
        # Never mix shards: DCP would overwrite some files and keep others.
        raise FSDPCheckpointError(f"fsdp: cannot save the {what} into {path}: the directory is not empty (a previous "
                                  "save left files there); save into a fresh checkpoint directory")
    os.makedirs(path, exist_ok=True)
    if writer.deferred:
        staged, group = _Staging.stage(strided.for_saving(state)), writer.background_group
        writer.library_write(lambda: _dcp_write(staged, path, name, what, group))
    else:
        writer.library_write(lambda: _dcp_write(strided.for_saving(state), path, name, what, None))


def _dcp_write(state: dict[str, Any], path: str, name: str, what: str, group: Any) -> list[str]:
    import torch.distributed.checkpoint as dcp

    storage = _recording_writer_class()(path)
    try:
        dcp.save(state, storage_writer=storage, process_group=group, no_dist=not _distributed())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        raise FSDPCheckpointError(f"fsdp: saving the {what} with torch.distributed.checkpoint into {path} failed: "
                                  f"{_describe(exc)}") from exc
    return [f"{name}/{file}" for file in sorted(storage.written)]


def _describe(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        described = []
        for rank, error in sorted(failures.items()):
            if isinstance(error, tuple) and error:  # (exception, traceback summary)
                error = error[0]
            described.append(f"rank {rank}: {type(error).__name__}: {error}")
        return "; ".join(described)
    return f"{type(exc).__name__}: {exc}"


def _recording_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        """A FileSystemWriter (fsyncs its files) that remembers which files this rank wrote."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.directory = path
            self.written: set[str] = set()

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)

            def record(done: Any) -> Any:
                results = done.value()
                self.written.update(result.storage_data.relative_path for result in results)
                return results

            return future.then(record)

        def finish(self, metadata: Any, results: Any) -> None:  # the coordinator only: writes .metadata
            before = set(os.listdir(self.directory))
            super().finish(metadata, results)
            self.written.update(set(os.listdir(self.directory)) - before)

    return RecordingWriter


# -- load ---------------------------------------------------------------------------------------


def load_state(run: RunContext, prepared: Sequence[PreparedModel], directory: str, allow_pickle: bool = False,
               manifest: Mapping[str, Any] | None = None) -> None:
    """Load what :func:`save_state` wrote (either format, at any world size and under any mesh:
    DCP reshards by parameter name), or the plain state a single-process or DDP run saved, into
    the prepared models and optimizers. Collective. Nothing is unpickled beyond ``weights_only``
    unless ``allow_pickle`` (see :mod:`torchrig_fsdp.safe_dcp`)."""
    optimizer_index = 0
    for index, item in enumerate(prepared):
        model = item.unwrapped
        sharded_dir = os.path.join(directory, model_name(index, True))
        full_file = os.path.join(directory, model_name(index, False))
        plain_file = next((os.path.join(directory, name) for name in model_files(index)
                           if os.path.isfile(os.path.join(directory, name))), None)
        is_plain = not os.path.isdir(sharded_dir) and not os.path.isfile(full_file) and plain_file is not None
        if os.path.isdir(sharded_dir):
            state = _dcp_load({"model": get_model_state_dict(model)}, sharded_dir, f"model {index}", allow_pickle)
            set_model_state_dict(model, state["model"])
        elif os.path.isfile(full_file):
            _load_full_model(run, model, _read_full(run, full_file, allow_pickle))
        elif is_plain:  # a single-process or DDP checkpoint: full weights, keyed by name
            _load_full_model(run, model, read_model_state(directory, index) if _reads(run) else {})
        else:
            described = ""
            if manifest is not None:
                saved, now = saved_layout(manifest), run_layout(run)
                described = (f" It was saved by the strategy {saved.get('strategy')!r} under "
                             f"{describe_layout(saved)}; this run is {describe_layout(now)}.")
            raise FSDPCheckpointError(
                f"fsdp: {directory} holds no state for model {index}: neither {model_name(index, True)}/ (sharded), "
                f"{model_name(index, False)} (full) nor {model_files(index)[0]} (plain).{described} Was it saved "
                "with another number of models, or by a strategy with its own format (load it with that strategy)?")
        for optimizer in item.optimizers:
            sharded_opt = os.path.join(directory, optimizer_name(optimizer_index, True))
            full_opt = os.path.join(directory, optimizer_name(optimizer_index, False))
            if os.path.isdir(sharded_opt):
                state = _dcp_load({"optimizer": get_optimizer_state_dict(model, optimizer)}, sharded_opt,
                                  f"optimizer {optimizer_index}", allow_pickle)
                set_optimizer_state_dict(model, optimizer, state["optimizer"])
            elif is_plain:  # position-keyed (optimizer.safetensors, or optimizer.bin): re-keyed by name
                full = {}
                if _reads(run):
                    names = {id(param): name for name, param in model.named_parameters()}
                    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
                    full = optimizer_by_name(read_optimizer_state(directory, optimizer_index), ordered,
                                                   f"{directory}: optimizer {optimizer_index}")
                _load_full_optimizer(run, model, optimizer, full, f"{directory}: optimizer {optimizer_index}")
            elif os.path.isfile(full_opt):
                _load_full_optimizer(run, model, optimizer, _read_full(run, full_opt, allow_pickle), full_opt)
            else:
                raise FSDPCheckpointError(f"fsdp: {directory} holds no state for optimizer {optimizer_index} "
                                          f"({optimizer_name(optimizer_index, True)}/ or "
                                          f"{optimizer_name(optimizer_index, False)})")
            optimizer_index += 1


def _reads(run: RunContext) -> bool:
    """Full state is read by rank 0 and broadcast; with one process, by it."""
    return not _distributed() or run.cluster.is_main_process


def _broadcast_options() -> Any:
    """Full state dicts are read on rank 0 and broadcast (the others pass ``{}``)."""
    return _options(full_state_dict=True, broadcast_from_rank0=True) if _distributed() else _options(full_state_dict=True)


def _load_full_model(run: RunContext, model: Any, full: dict[str, Any]) -> None:
    """Load a full model state dict (on rank 0; ``{}`` elsewhere) into a sharded model, strided
    shards placed by :func:`torchrig_fsdp.strided.place_from_rank0` (torch slices them wrongly)."""
    whole = dict(full)  # torch replaces the values of the dict it is given with the distributed ones
    set_model_state_dict(model, full, options=_broadcast_options())
    if _distributed():
        strided.place_from_rank0(strided.model_targets(model), whole.__getitem__, _device(run))


def _device(run: RunContext) -> torch.device:
    """Where collectives run (a broadcast over nccl needs a CUDA tensor even if parameters are offloaded)."""
    return run.device.device if run.device is not None else torch.device("cpu")


def _load_full_optimizer(run: RunContext, model: Any, optimizer: Any, full: dict[str, Any], path: str) -> None:
    """Load a full optimizer state dict into a sharded optimizer.

    torch's ``set_optimizer_state_dict`` cannot distribute a full state to an optimizer that keeps
    no tensors (SGD without momentum: it fails with "Expected device to be set"). Such an
    optimizer's whole state is its param groups' hyperparameters, which are restored directly —
    read on rank 0 and broadcast, as the tensors would be.
    """
    local = get_optimizer_state_dict(model, optimizer)  # also creates lazily-made state, as loading would
    keeps_tensors = any(isinstance(value, torch.Tensor) and value.dim() > 0
                        for per_param in local.get("state", {}).values() for value in per_param.values())
    if keeps_tensors:
        whole = {name: dict(per_param) for name, per_param in full.get("state", {}).items()}  # as above
        set_optimizer_state_dict(model, optimizer, full, options=_broadcast_options())
        if _distributed():
            strided.place_from_rank0(strided.optimizer_targets(model, optimizer),
                                     lambda key: whole[key[0]][key[1]], _device(run))
        return
    groups = [{key: value for key, value in group.items() if key != "params"} for group in full.get("param_groups", [])]
    if _distributed():
        shared = [groups]
        dist.broadcast_object_list(shared, src=0)
        groups = shared[0]
    if len(groups) != len(optimizer.param_groups):
        raise FSDPCheckpointError(f"fsdp: {path} holds {len(groups)} parameter groups; the optimizer has "
                                  f"{len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)


def _read_full(run: RunContext, path: str, allow_pickle: bool) -> dict[str, Any]:
    if _distributed() and not run.cluster.is_main_process:
        return {}
    return load_pickled(path, "a full FSDP state dict", allow_pickle=allow_pickle)


def _dcp_load(state: dict[str, Any], path: str, what: str, allow_pickle: bool) -> dict[str, Any]:
    """``state`` filled from the DCP directory ``path`` (strided shards through contiguous stand-ins:
    :mod:`torchrig_fsdp.strided`)."""
    import torch.distributed.checkpoint as dcp

    def read(standing: dict[str, Any]) -> None:
        dcp.load(standing, storage_reader=safe_dcp.reader(path, allow_pickle),
                 planner=safe_dcp.planner(path, allow_pickle), no_dist=not _distributed())

    try:
        return strided.load(state, read)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        raise FSDPCheckpointError(f"fsdp: loading the {what} with torch.distributed.checkpoint from {path} failed: "
                                  f"{_describe(exc)}") from exc


# -- export -------------------------------------------------------------------------------------


def read_sharded_model(path: str, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict of one ``pytorch_model_fsdp_<i>/`` DCP directory, in this process
    (no process group): every shard is read and assembled (safely unless ``allow_pickle``)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=safe_dcp.reader(path, allow_pickle),
                         planner=safe_dcp.planner(path, allow_pickle, _EmptyStateDictLoadPlanner, keys={"model"}),
                         no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise FSDPCheckpointError(f"fsdp: reading the sharded checkpoint {path} failed: {_describe(exc)}") from exc
    model = state.get("model")
    if not isinstance(model, dict):
        raise FSDPCheckpointError(f"fsdp: {path} is a torch.distributed.checkpoint without a 'model' entry; it was not "
                                  "written by torchrig's fsdp strategy")
    return model


__all__ = ["FULL", "SHARDED", "FSDPCheckpointError", "full_model_state", "load_state", "model_name", "optimizer_name",
           "read_sharded_model", "save_state"]
