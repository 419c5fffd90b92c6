"""``Accelerator``: the user-facing object, with Hugging Face Accelerate's names.

The Accelerator reads the configuration itself — the machine's default file, the run's config
file (``TORCHRIG_CONFIG_FILE``), ``TORCHRIG_*`` variables and the flags ``torchrig launch``
passes on — so ``python train.py``, ``torchrun train.py`` and ``torchrig launch train.py`` agree.
Its own arguments sit between the machine's default file and the run's file in precedence
(see :mod:`torchrig.config.resolve`). Configuration is validated, with the script's arguments
merged, before any process group is created, so a bad configuration fails on every rank with
the same message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torchrig.config.resolve import Layer, ResolvedConfig, Schema, resolve_config
from torchrig.errors import ConfigError
from torchrig.plugin_manager import PluginHost
from torchrig.run import RunContext
from torchrig.runtime import detect_cluster, start_run

#: Accelerate arguments torchrig does not support, and why (passing one is an error, never ignored).
_UNSUPPORTED_ARGUMENTS = {
    "torch_tp_plugin": "tensor parallelism is not supported",
    "megatron_lm_plugin": "Megatron-LM is not supported",
    "parallelism_config": "tensor/context parallelism is not supported",
    "deepspeed_plugins": "several DeepSpeed configurations per Accelerator are not supported; each prepared model "
    "gets its own engine from the one deepspeed_plugin",
}


def accelerator_arguments(schema: Schema, **kwargs: Any) -> dict[str, Any]:
    """Translate ``Accelerator(...)`` arguments into configuration arguments.

    Options objects (``DataLoaderConfiguration``, ``kwargs_handlers`` items, a plugin's
    ``FullyShardedDataParallelPlugin``...) go to the section whose options class they are; a
    strategy plugin's options object also selects that strategy, as in Accelerate.
    """
    problems: list[str] = []
    arguments: dict[str, Any] = {}
    sections_by_type = {section.options: key for key, section in schema.sections.items()}

    def put_section_object(obj: Any, where: str) -> None:
        key = sections_by_type.get(type(obj))
        if key is None:
            problems.append(f"{where}: {type(obj).__name__} is not an options class of torchrig or an installed plugin")
            return
        arguments[key] = obj
        owner = schema.section_owner.get(key, "")
        if owner.startswith("strategy:"):
            arguments.setdefault("strategy", owner.partition(":")[2])

    for name, reason in _UNSUPPORTED_ARGUMENTS.items():
        if kwargs.pop(name, None) is not None:
            problems.append(f"Accelerator({name}=...): {reason}")
    for name in ("mixed_precision", "strategy", "strict_config"):
        if kwargs.get(name) is not None:
            arguments[name] = kwargs.pop(name)
        kwargs.pop(name, None)
    steps = kwargs.pop("gradient_accumulation_steps", 1)
    if steps != 1:
        arguments["gradient_accumulation_steps"] = steps
    if kwargs.pop("cpu", False):
        arguments["use_cpu"] = True
    log_with = kwargs.pop("log_with", None)
    if log_with is not None:
        arguments["log_with"] = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    split_batches = kwargs.pop("split_batches", None)
    for name in ("dataloader_config", "project_config", "gradient_accumulation_plugin", "dynamo_plugin",
                 "deepspeed_plugin", "fsdp_plugin"):
        obj = kwargs.pop(name, None)
        if obj is not None:
            put_section_object(obj, f"Accelerator({name}=...)")
    for index, handler in enumerate(kwargs.pop("kwargs_handlers", None) or ()):
        put_section_object(handler, f"Accelerator(kwargs_handlers[{index}])")
    project_dir = kwargs.pop("project_dir", None)
    if project_dir is not None:
        _merge_field(arguments, "project_config", "project_dir", os.fspath(project_dir))
    if split_batches is not None:
        _merge_field(arguments, "dataloader_config", "split_batches", split_batches)
    backend = kwargs.pop("dynamo_backend", None)
    if backend is not None:
        _merge_field(arguments, "dynamo_config", "backend", getattr(backend, "value", backend))
    if kwargs:
        problems.extend(f"Accelerator({name}=...): unknown argument" for name in sorted(kwargs))
    if problems:
        raise ConfigError(problems, header="invalid Accelerator arguments")
    return arguments


def _merge_field(arguments: dict[str, Any], section: str, field: str, value: Any) -> None:
    """Add one field to a section given as an object or a mapping (an object sets all fields)."""
    current = arguments.get(section)
    if current is None:
        arguments[section] = {field: value}
    elif isinstance(current, Mapping):
        arguments[section] = {**current, field: value}
    else:
        import attrs

        arguments[section] = attrs.evolve(current, **{field: value})


class Accelerator:
    """Run one training script on one process or many, under the configured strategy.

    Arguments follow Hugging Face Accelerate's; ``strategy``, ``config_file`` and
    ``strict_config`` are torchrig's own.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Sequence[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        strategy: str | None = None,
        config_file: str | os.PathLike | None = None,
        strict_config: bool | None = None,
    ) -> None:
        self.device_placement = device_placement
        self.rng_types = list(rng_types) if rng_types is not None else None
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self._host = PluginHost()
        schema = Schema(self._host)
        arguments = accelerator_arguments(
            schema,
            split_batches=split_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            dataloader_config=dataloader_config,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            log_with=log_with,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
            strategy=strategy,
            strict_config=strict_config,
        )
        self.config: ResolvedConfig = resolve_config(self._host, arguments=arguments, config_file=config_file)
        self._host.disable(self.config["disable_plugins"])
        cluster = detect_cluster(self._host, self.config)
        if cluster.world_size > 1 and self.config.source("strategy").layer is Layer.DEFAULT:
            # The job has several processes (torchrun, torchrig launch) and nothing chose a
            # strategy: resolve again so the default data-parallel strategy is picked.
            self.config = resolve_config(self._host, arguments=arguments, config_file=config_file,
                                         world_size=cluster.world_size, warn=False)
        self._run: RunContext = start_run(self._host, self.config, cluster=cluster)

    # -- where this process sits ----------------------------------------------------------

    @property
    def device(self) -> Any:
        """The ``torch.device`` of this process."""
        assert self._run.device is not None
        return self._run.device.device

    @property
    def process_index(self) -> int:
        return self._run.cluster.rank

    @property
    def local_process_index(self) -> int:
        return self._run.cluster.local_rank

    @property
    def num_processes(self) -> int:
        return self._run.cluster.world_size

    @property
    def is_main_process(self) -> bool:
        return self._run.cluster.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._run.cluster.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._run.cluster.rank == self._run.cluster.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self._run.cluster.world_size > 1

    # -- what was configured --------------------------------------------------------------

    @property
    def strategy(self) -> str:
        """The strategy plugin in use (``single``, ``ddp``, ``fsdp``, ``deepspeed``...)."""
        return str(self.config["strategy"])

    @property
    def mixed_precision(self) -> str:
        return str(self.config["mixed_precision"])

    @property
    def gradient_accumulation_steps(self) -> int:
        steps = self.config["gradient_accumulation_plugin.num_steps"]
        return int(steps if steps is not None and not self.config.is_set("gradient_accumulation_steps")
                   else self.config["gradient_accumulation_steps"])

    @property
    def project_dir(self) -> str | None:
        return self.config["project_config.project_dir"]

    @property
    def logging_dir(self) -> str | None:
        logging_dir, project_dir = self.config["project_config.logging_dir"], self.project_dir
        if logging_dir is None:
            return project_dir
        return os.path.join(project_dir, logging_dir) if project_dir else logging_dir


__all__ = ["Accelerator", "accelerator_arguments"]
