"""The ``fsdp`` strategy's runtime: FSDP2, ``torch.distributed.fsdp.fully_shard``.

What it owns (its :class:`~torchrig.plugin.types.Capabilities`): precision — FSDP2's
``MixedPrecisionPolicy`` casts parameters for compute and reduces gradients in fp32, so the
precision plugin's autocast is not installed — and the checkpoint format (sharded, through
``torch.distributed.checkpoint``; see :mod:`torchrig_fsdp.checkpoint`). Backward, the optimizer
step and accumulation stay the core's: the step plan gets a ``no_sync`` that turns off FSDP2's
gradient reduce-scatter on micro-steps (``set_requires_gradient_sync(False)``), a clipping
function that computes the global norm over sharded (DTensor) gradients, and, for fp16, a
``ShardedGradScaler``.

With one process there is nothing to shard (FSDP2 needs a process group): the model is left as
it is, the precision plugin applies as under ``single``, and checkpoints are still written with
``torch.distributed.checkpoint`` so that they load at another world size (1→2, 2→1);
``cpu_offload`` is refused there (it offloads shards: one process would offload nothing).

Which blocks get their own ``fully_shard``: :mod:`torchrig_fsdp.wrapping`. Every option of
``fsdp_config`` and how it maps onto FSDP2 is tabled in ``docs/fsdp.md``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchrig.plugin import (
    Capabilities,
    CoreOptions,
    PreparedModel,
    RunContext,
    StashKey,
    StepPlanBuilder,
    grad_scaler_kwargs,
    hookimpl,
    install_loss_scaling,
)

from torchrig_fsdp import activation_checkpointing, async_tp, expert_parallel, pipeline, submeshes
from torchrig_fsdp import checkpoint as fsdp_checkpoint
from torchrig_fsdp import mesh as nd
from torchrig_fsdp.constants import HYBRID, SECTION
from torchrig_fsdp.explain import FSDPConfigError, noted
from torchrig_fsdp.materialize import MaterializeError, materialize, meta_modules
from torchrig_fsdp.options import FullyShardedDataParallelPlugin
from torchrig_fsdp.partial_norms import dtensor_grad_norm
from torchrig_fsdp.wrapping import apply_tensor_parallel, as_modules, wrap_blocks

#: The device mesh of this run (built in ``torchrig_configure``; ``None`` with one process).
MESH = StashKey[Any]("fsdp.mesh")
#: The process group of this rank's data-parallel peers when the mesh has a ``tp`` or ``cp`` axis (else None).
DP_GROUP = StashKey[Any]("fsdp.dp_group")
#: The mesh's named sub-meshes (``dp``, ``dp_shard_cp``, ``dp_cp``, each axis): torchrig_fsdp.submeshes.
SUBMESHES = StashKey[Any]("fsdp.submeshes")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}

#: ``mixed_precision`` -> the dtype FSDP2 casts parameters to for compute. fp8: the converted
#: Linear layers compute in fp8 (torchao casts them), everything else in bf16 (as torchtitan).
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}

#: fp16 needs a loss scaler that sees every gradient as a DTensor (ShardedGradScaler); with tensor
#: parallel alone the parameters outside the plan stay plain tensors, and torch's unscale refuses the mix.
_FP16_TP_ALONE = ("mixed_precision: fp16 with tensor parallel alone (no dp_shard/dp_replicate axis) is not supported: "
                  "the loss scaler cannot unscale plain and tensor-parallel gradients together; use bf16, or add a "
                  "data axis (parallelism_config.dp_shard_size)")


def fsdp_options(run: RunContext) -> FullyShardedDataParallelPlugin:
    """The resolved ``fsdp_config`` section (with Python-only values such as ``ignored_modules``)."""
    return run.section(FullyShardedDataParallelPlugin)


def mesh_shape(strategy: str, world_size: int, num_nodes: int, local_world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh a sharding strategy asks for: 1-D over every rank for FULL_SHARD and
    SHARD_GRAD_OP; (replicas, shards) for the hybrids — (machines, processes per machine), so
    (1, N) on one machine — and (world, 1) for NO_SHARD (replicated parameters)."""
    if strategy in HYBRID:
        replicas = num_nodes if num_nodes > 1 and world_size % num_nodes == 0 else max(1, world_size // max(1, local_world_size))
        return (replicas, world_size // replicas), ("dp_replicate", "dp_shard")
    if strategy == "NO_SHARD":
        return (world_size, 1), ("dp_replicate", "dp_shard")
    return (world_size,), ("dp_shard",)


class FSDPStrategy:
    """FSDP2 runtime. One instance per plugin host (per Accelerator)."""

    def __init__(self) -> None:
        self.scaler: Any = None

    # -- environment ------------------------------------------------------------------------

    @hookimpl
    def torchrig_configure(self, run: RunContext) -> None:
        """Build the device mesh once per run (collective: hybrid meshes create sub-groups)."""
        if run.cluster.world_size <= 1:
            if nd.parallelism(run).enabled:  # sizes that need several ranks are an error, not ignored
                nd.mesh_layout(nd.parallelism(run), 1)
            if fsdp_options(run).cpu_offload:  # offloading happens to shards: one process has none
                raise FSDPConfigError(
                    f"{SECTION}.cpu_offload (Accelerate: fsdp_offload_params) is on, but this run has one process: "
                    "the fsdp strategy shards (and offloads) over the ranks of a process group, and with one process it "
                    "leaves the model unsharded, so nothing would be offloaded; launch 2 or more processes (torchrig launch "
                    "--num_processes N) or set cpu_offload: false")
            run.stash[MESH] = None
            return
        from torch.distributed.device_mesh import init_device_mesh

        options = fsdp_options(run)
        assert run.device is not None
        cluster = run.cluster
        if nd.parallelism(run).enabled:  # parallelism_config describes the mesh (docs/parallelism.md)
            shape, names = nd.mesh_layout(nd.parallelism(run), cluster.world_size)
        else:
            shape, names = mesh_shape(options.sharding_strategy, cluster.world_size, cluster.num_nodes,
                                      cluster.local_world_size)
        if "pp" in names:
            pipeline.check(nd.parallelism(run), options)
        mesh = run.stash[MESH] = init_device_mesh(run.device.device.type, shape, mesh_dim_names=names)
        named = run.stash[SUBMESHES] = (submeshes.named_meshes(mesh) if nd.parallelism(run).enabled
                                        else {name: mesh[name] for name in names})
        named.update(expert_parallel.expert_submeshes(mesh, nd.parallelism(run).ep_size))  # ep, efsdp
        run.stash[DP_GROUP] = nd.data_parallel_group(mesh, named)
        async_tp.enable(run, named.get("tp"))
        _explain_no_ops(options)

    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        """Data parallelism spans dp_replicate x dp_shard: the ranks of one tp group share batches."""
        mesh = run.stash.get(MESH)
        sharded = run.cluster.world_size > 1
        if mesh is None:
            return Capabilities(owns_precision=sharded, fully_shard_parameters=sharded,
                                data_parallel_size=run.cluster.world_size, data_parallel_rank=run.cluster.rank)
        size, rank = nd.data_parallel_layout(mesh)
        # Tensor parallel alone shards nothing with fully_shard, so no MixedPrecisionPolicy casts:
        # the precision plugin's autocast applies then.
        owns = sharded and (not nd.parallelism(run).enabled or nd.data_mesh(mesh) is not None)
        return Capabilities(owns_precision=owns, fully_shard_parameters=owns, data_parallel_size=size,
                            data_parallel_rank=rank, device_mesh=mesh, data_parallel_group=run.stash.get(DP_GROUP),
                            device_submeshes=run.stash.get(SUBMESHES, {}))

    # -- preparation -------------------------------------------------------------------------

    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        assert run.device is not None
        device = run.device.device
        prepared = PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))
        mesh = run.stash.get(MESH)
        if mesh is None:  # one process: nothing to shard
            if device_placement and not _has_meta(model):
                model.to(device)
            if _has_meta(model) and not fsdp_options(run).cpu_ram_efficient_loading:
                _materialize(model, fsdp_options(run), None, device, run)
            if activation_checkpointing.wanted(fsdp_options(run)):  # unsharded, but its blocks still checkpointed
                activation_checkpointing.install(run, model, wrap_blocks(model, fsdp_options(run), run), fsdp_options(run))
            return prepared
        options = fsdp_options(run)
        slots = _parameter_slots(model)
        if device_placement and not _has_meta(model):
            model.to(device)
        rank0_state = None
        if options.cpu_ram_efficient_loading:
            # Only rank 0's weights count; the others may be on the meta device.
            rank0_state = model.state_dict() if run.cluster.is_main_process else {}
        elif options.sync_module_states:
            _broadcast_from_rank0(model)
        pp, config = nd.pp_mesh(mesh), nd.parallelism(run)
        if pp is not None:  # this rank's stage, then TP and fully_shard on it as on a whole model
            if config.tp_plan and nd.tp_mesh(mesh) is not None:  # every pattern matches in the whole model
                nd.resolve_plan(model, config.tp_plan, config.loss_parallel, "parallelism_config.tp_plan")
            # a planned run keeps what finds the tensors between stages, taken before the split
            probe = pipeline.boundary_probe(model, pp.size(), config.pp_split_points,
                                            config.pp_split_fn) if run.planning else None
            model, stages, num_stages = pipeline.build_rank(model, pp.get_local_rank(), pp.size(), config.pp_schedule,
                                                            config.pp_split_points, config.pp_split_fn)
            prepared.unwrapped = prepared.model = model
            for optimizer in prepared.optimizers:
                pipeline.prune_optimizer(optimizer, model)
        self._parallelize(run, model, mesh, options, rank0_state, slots, prepared,
                          roots=[stage for _, stage in stages] if pp is not None else [model])
        if pp is not None:
            prepared.model = pipeline.wrap(device, model, stages, num_stages, mesh, config.pp_schedule,
                                           config.pp_microbatches or pp.size(), config.pp_loss_fn, probe)
        return prepared

    def _parallelize(self, run: RunContext, model: torch.nn.Module, mesh: Any, options: FullyShardedDataParallelPlugin,
                     rank0_state: dict[str, Any] | None, slots: list[Any], prepared: PreparedModel,
                     roots: list[torch.nn.Module]) -> None:
        """Tensor parallel on ``model``, then ``fully_shard`` over the data mesh of each of ``roots``
        (the whole model, or each pipeline stage of this rank), its blocks first."""
        assert run.device is not None
        device = run.device.device
        # the model's or the user's plan, made to follow LoRA adapters when the model has some (wrapping.py)
        apply_tensor_parallel(run, model, mesh, options.parallelize_fn, require_match=nd.pp_mesh(mesh) is None)
        named = run.stash.get(SUBMESHES, {})
        experts = expert_parallel.place_experts(model, named)  # ep_size: experts Shard(0) over ep, before fully_shard
        if nd.parallelism(run).loss_parallel:
            nd.wrap_loss_parallel(model)
        shard_mesh = nd.data_mesh(mesh) if nd.parallelism(run).enabled else mesh
        if shard_mesh is None:  # tensor parallel alone: no data axis to shard over
            if run.section(CoreOptions).mixed_precision == "fp16" and nd.tp_mesh(mesh) is not None:
                raise FSDPConfigError(_FP16_TP_ALONE)
            for root in roots if activation_checkpointing.wanted(options) else ():
                activation_checkpointing.install(run, root, wrap_blocks(root, options, run), options)
            _materialize(model, options, rank0_state, device, run)
            for optimizer in prepared.optimizers:
                remap_optimizer(optimizer, slots)
            return
        for root in roots:
            blocks = wrap_blocks(root, options, run)
            activation_checkpointing.install(run, root, blocks, options)  # before fully_shard: recompute inside its hooks
            kwargs = _shard_kwargs(run, options, root, shard_mesh)
            policy = kwargs.pop("mp_policy")
            # Blocks return what they computed in (a block's output feeds the next block or the root's
            # own layers, in param_dtype); only the root's output is cast (output_dtype).
            block_policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                                cast_forward_inputs=policy.cast_forward_inputs)
            if experts:  # over efsdp, before the blocks holding them (expert_parallel.py)
                expert_kwargs = {key: value for key, value in kwargs.items() if key != "mesh"}
                expert_parallel.fully_shard_experts(root, experts, expert_parallel.experts_shard_mesh(named["experts"]),
                                                    mp_policy=block_policy, **expert_kwargs)
            for block in blocks:  # children before the blocks containing them, then the root
                fully_shard(block, mp_policy=block_policy, **kwargs)
            if options.reshard_after_forward is None and kwargs["reshard_after_forward"] is True:
                # Unset by the user: let FSDP2 keep the root's parameters gathered from forward to
                # backward (its heuristic, applied only when the argument is left None). An explicit
                # True costs one more all-gather per step (measured: B9, 4% on 2 CPU ranks).
                kwargs["reshard_after_forward"] = None
            fully_shard(root, mp_policy=policy, **kwargs)
            _set_prefetch(blocks, options)
        _materialize(model, options, rank0_state, device, run)
        for optimizer in prepared.optimizers:
            remap_optimizer(optimizer, slots)

    @hookimpl
    def torchrig_strategy_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        plan.set("no_sync", _no_sync)
        group = pipeline.pp_group(run.stash.get(MESH))
        # pipeline stages: the total norm adds every stage's gradients (reduced over the pp group)
        plan.set("clip_grad_norm", clip_grad_norm if group is None else functools.partial(clip_grad_norm, group=group))
        if run.cluster.world_size > 1 and run.section(CoreOptions).mixed_precision == "fp16":
            self._install_scaler(run, plan)
        if nd.parallelism(run).loss_parallel and run.cluster.world_size > 1:
            plan.set("backward", nd.loss_parallel_backward(plan.get("backward")))

    def _install_scaler(self, run: RunContext, plan: StepPlanBuilder) -> None:
        """fp16: FSDP2 computes in fp16 (its policy), so the loss is scaled and the step goes
        through a ``ShardedGradScaler``, which finds infs across shards and skips those steps."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        assert run.device is not None
        self.scaler = ShardedGradScaler(device=run.device.device.type, **grad_scaler_kwargs(run))
        install_loss_scaling(plan, self.scaler)

    @hookimpl(optionalhook=True)
    def torchrig_checkpoint_state(self, run: RunContext) -> dict[str, Any]:
        """The fp16 loss scale resumes with the run (Accelerate's ``scaler.pt``)."""
        return {"scaler": self.scaler} if self.scaler is not None else {}

    # -- checkpoints -------------------------------------------------------------------------

    @hookimpl
    def torchrig_save_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     writer: Any) -> list[str]:
        return fsdp_checkpoint.save_state(run, prepared, fsdp_options(run).state_dict_type, writer)

    @hookimpl
    def torchrig_load_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     manifest: Any, allow_pickle: bool) -> bool:
        fsdp_checkpoint.load_state(run, prepared, directory, allow_pickle, manifest)
        return True

    @hookimpl
    def torchrig_full_state_dict(self, run: RunContext, prepared: PreparedModel) -> dict[str, Any]:
        state_dict_config = fsdp_options(run).state_dict_config or {}  # torch's StateDictConfig arguments
        rank0_only = state_dict_config.get("rank0_only", True)
        group = pipeline.pp_group(run.stash.get(MESH))
        if group is not None:  # each stage gathers its shards, then the stages are joined
            stage = fsdp_checkpoint.full_model_state(run, prepared.unwrapped, rank0_only=False, offload_to_cpu=True)
            return pipeline.join_stages(stage, group, rank0_only=rank0_only)
        return fsdp_checkpoint.full_model_state(run, prepared.unwrapped, rank0_only=rank0_only,
                                                offload_to_cpu=state_dict_config.get("offload_to_cpu", True))


def mixed_precision_policy(run: RunContext, options: FullyShardedDataParallelPlugin) -> MixedPrecisionPolicy:
    """``mixed_precision`` bf16/fp16: parameters cast to it for compute, gradients reduced in fp32,
    the root's outputs returned in fp32 (the loss is computed in full precision, as with autocast).
    ``fsdp_config.mixed_precision_policy`` overrides single fields."""
    fields: dict[str, Any] = {}
    dtype = _COMPUTE_DTYPES.get(run.section(CoreOptions).mixed_precision)
    if dtype is not None and dtype is not torch.float32:
        fields = {"param_dtype": dtype, "reduce_dtype": torch.float32, "output_dtype": torch.float32}
    for name, value in (options.mixed_precision_policy or {}).items():
        if name == "buffer_dtype":
            noted.info("fsdp.buffer_dtype", f"fsdp: {SECTION}.mixed_precision_policy.buffer_dtype has no effect: FSDP2 "
                                            "does not cast buffers")
            continue
        if isinstance(value, str):
            value = _DTYPES[value.lower().removeprefix("torch.")]
        fields[name] = value
    return MixedPrecisionPolicy(**fields)


def _shard_kwargs(run: RunContext, options: FullyShardedDataParallelPlugin, model: torch.nn.Module, mesh: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": options.resolved_reshard_after_forward,
                              "mp_policy": mixed_precision_policy(run, options)}
    if options.cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    ignored = {p for m in as_modules(options.ignored_modules) for p in m.parameters()}
    if ignored:
        kwargs["ignored_params"] = ignored
    return kwargs


def _set_prefetch(blocks: list[torch.nn.Module], options: FullyShardedDataParallelPlugin) -> None:
    """``forward_prefetch``: each block starts the next block's all-gather during its forward
    (FSDP2's explicit forward prefetch). Backward prefetching of the next block is FSDP2's default."""
    if options.forward_prefetch:
        for block, following in itertools.pairwise(blocks):
            block.set_modules_to_forward_prefetch([following])


def _explain_no_ops(options: FullyShardedDataParallelPlugin) -> None:
    """FSDP1 options FSDP2 has no knob for: accepted, and said once (docs/fsdp.md tables them)."""
    if options.backward_prefetch == "BACKWARD_POST":
        noted.info("fsdp.backward_post", f"fsdp: {SECTION}.backward_prefetch BACKWARD_POST has no FSDP2 equivalent; "
                                         "FSDP2 prefetches the next block's all-gather in backward (as BACKWARD_PRE)")
    elif options.backward_prefetch == "NO_PREFETCH":
        noted.info("fsdp.no_prefetch", f"fsdp: {SECTION}.backward_prefetch NO_PREFETCH: no explicit prefetching is set; "
                                       "FSDP2 still overlaps the next block's all-gather in backward (it has no off switch)")
    if not options.use_orig_params:
        noted.info("fsdp.use_orig_params", f"fsdp: {SECTION}.use_orig_params has no effect: FSDP2 always keeps the "
                                           "original parameters (as DTensors)")
    if not options.limit_all_gathers:
        noted.info("fsdp.limit_all_gathers", f"fsdp: {SECTION}.limit_all_gathers has no effect: FSDP2 limits "
                                             "in-flight all-gathers itself")


# -- parameters, optimizers ---------------------------------------------------------------------


def _has_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _parameter_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Any]]:
    """Where each parameter lives (module, attribute name, the parameter object) before sharding:
    ``fully_shard`` replaces the objects in place, so these slots find the new ones."""
    return [(module, name, param) for module in model.modules() for name, param in module._parameters.items()
            if param is not None]


def remap_optimizer(optimizer: torch.optim.Optimizer, slots: list[tuple[torch.nn.Module, str, Any]]) -> int:
    """Point an optimizer built over the unsharded model at the sharded parameters that replaced
    them (and move any existing per-parameter state, sharded like its parameter). Returns how many
    parameters were remapped. Accelerate leaves such optimizers on the old tensors, which then
    never change (accelerate#3209)."""
    replaced: dict[int, Any] = {}
    for module, name, old in slots:
        new = module._parameters.get(name)
        if new is not None and new is not old:
            replaced[id(old)] = new
    count = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            new = replaced.get(id(param))
            if new is None:
                continue
            params[index] = new
            count += 1
            if param in optimizer.state:
                optimizer.state[new] = _shard_state(optimizer.state.pop(param), param, new)
    return count


def _shard_state(state: dict[str, Any], old: Any, new: Any) -> dict[str, Any]:
    """Optimizer state of a parameter (e.g. Adam's moments, from steps taken before ``prepare``)
    laid out like the sharded parameter; scalars (``step``) stay as they are."""
    from torch.distributed.tensor import distribute_tensor

    result = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == old.shape and value.dim() > 0:
            value = distribute_tensor(value.to(new.device), new.device_mesh, new.placements)
        result[key] = value
    return result


def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    """``sync_module_states``: every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.is_meta:
                dist.broadcast(tensor.data, src=0)


def _materialize(model: torch.nn.Module, options: FullyShardedDataParallelPlugin, rank0_state: dict[str, Any] | None,
                 device: torch.device, run: RunContext) -> None:
    """Meta-device parameters get storage after sharding (each rank only its shard); then either
    rank 0's weights are broadcast into them (``cpu_ram_efficient_loading``) or each module that
    had meta tensors is initialised on rank 0 and sharded out (:mod:`torchrig_fsdp.materialize`).
    A planned run (``run.planning``) keeps its shards on the meta device: nothing exists to load."""
    if run.planning:
        return
    modules = meta_modules(model)
    if modules:
        model.to_empty(device=device)
    if rank0_state is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, rank0_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    elif modules:
        try:
            materialize(model, modules, options.param_init_fn, device, run.cluster.is_main_process,
                        f"{SECTION}.param_init_fn")
        except MaterializeError as exc:
            raise FSDPConfigError(str(exc)) from None


# -- the step plan ------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_sync(model: Any) -> Iterator[None]:
    """Micro-steps accumulate unsharded gradients locally: no reduce-scatter until the step that syncs."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(parameters: Any, max_norm: float, norm_type: float = 2.0, *, group: Any = None) -> torch.Tensor:
    """``clip_grad_norm_`` whose norm covers every shard: DTensor gradients are grouped by mesh and
    placement, each group's norm is made global, the groups are combined — and with ``group`` (the
    pipeline's stages) combined across its ranks — then every gradient is scaled. Returns a plain
    tensor, equal on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads and group is None:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else grad.device
        groups.setdefault(key, []).append(grad)
    norms = [torch.zeros((), device=torch.device("cpu") if group is None else pipeline.group_device(group))]
    for members in groups.values():
        if isinstance(members[0], DTensor):  # one all-reduce over the sharded axes (torchrig_fsdp.partial_norms)
            norms.append(dtensor_grad_norm(members, norm_type, may_flatten=group is None))
        else:
            norms.append(torch.nn.utils.get_total_norm(members, norm_type=norm_type))
    device = norms[-1].device
    norms = [n.to(device).float() for n in norms]
    if math.isinf(norm_type):
        total = torch.stack(norms).max()
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = torch.stack(norms).pow(norm_type).sum()
        if group is not None:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for key, members in groups.items():
            if isinstance(key, tuple):  # DTensor gradients: the same factor on every shard
                mesh = key[0]
                factor = DTensor.from_local(coefficient.to(members[0].device), mesh, [Replicate()] * mesh.ndim,
                                            run_check=False)
            else:
                factor = coefficient.to(key)
            for grad in members:
                grad.mul_(factor)
    return total


__all__ = ["MESH", "FSDPConfigError", "FSDPStrategy", "clip_grad_norm", "mesh_shape", "mixed_precision_policy",
           "remap_optimizer"]
