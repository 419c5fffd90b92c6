"""``DeepSpeedPlugin``: Accelerate's class and parameters, as torchrig's ``deepspeed_config``.

The fields are Accelerate's; in a config file they have the same names (Accelerate's
``deepspeed_config:`` keys, ``deepspeed_config_file`` for ``hf_ds_config``). How they combine with
a DeepSpeed JSON (``hf_ds_config``), as in Accelerate: the JSON is the DeepSpeed configuration;
a field set here fills the JSON's ``"auto"`` (or missing) value, and a field set here that
contradicts a concrete JSON value is an error naming both (never silently one of them). Fields
left at ``None`` defer to the JSON, then to the default given in their help.

Torch-free: DeepSpeed is imported only by the runtime and, lazily, by the validation hook.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
from torchrig.plugin import at_least, between, class_names, option

from torchrig_deepspeed.constants import OFFLOAD_DEVICES
from torchrig_deepspeed.ds_json import load_deepspeed_json

#: The only ``deepspeed_multinode_launcher`` torchrig has: ``torchrig launch`` on each machine.
STANDARD_LAUNCHER = "standard"


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _ds_config(value: Any) -> Any:
    """A path (``str``/``os.PathLike``), a mapping, or an object carrying one (transformers'
    ``HfDeepSpeedConfig`` has ``.config``). ``"none"``/``""`` (what Accelerate writes when no file is
    used) -> None."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    if not isinstance(value, (str, Mapping)) and isinstance(getattr(value, "config", None), Mapping):
        return dict(value.config)
    return value


def _optional_text(value: Any) -> Any:
    """Accelerate writes ``none``/empty for an unused text option."""
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    return value


def _launcher(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in (None, STANDARD_LAUNCHER):
        raise ValueError(
            f"{value!r} is not supported: torchrig starts the workers of each machine with `torchrig launch "
            "--num_machines N --machine_rank R` run on that machine (DeepSpeed's 'standard' launcher); the ssh/MPI "
            "fan-out of pdsh, openmpi, mvapich, mpich, slurm or nossh is not implemented", attribute)


def _hostfile(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        raise ValueError(
            "is not supported: hostfiles (and their inclusion/exclusion filters) are read by DeepSpeed's pdsh/MPI "
            "launchers; run `torchrig launch --num_machines N --machine_rank R --main_process_ip HOST` on each "
            "machine instead", attribute)


def _offload_device(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value not in OFFLOAD_DEVICES:
        raise ValueError(f"must be one of {', '.join(OFFLOAD_DEVICES)}, got {value!r}", attribute)


#: The configuration dict of each live DeepSpeedPlugin, by identity: one dict per plugin object (as
#: Accelerate's), so that what ``prepare`` fills in is visible through ``deepspeed_config``.
_CONFIG_DICTS: dict[int, dict[str, Any]] = {}


@attrs.frozen(kw_only=True)
class DeepSpeedPlugin:
    """DeepSpeed options (``deepspeed_config``), with Accelerate's class name and parameter names."""

    hf_ds_config: dict[str, Any] | str | None = option(
        None, help="the DeepSpeed configuration: a JSON file path (relative to the working directory, as in "
                   "Accelerate and DeepSpeed), base64 JSON, or a mapping from Python",
        aliases=("deepspeed_config_file", "config_file"), normalize=_ds_config, converter=_ds_config)
    gradient_accumulation_steps: int | None = option(
        None, help="micro-steps per optimizer step (default: the top-level gradient_accumulation_steps)",
        validator=at_least(1))
    gradient_clipping: float | None = option(
        None, help="clip gradients to this global norm (fills the JSON's gradient_clipping; default: none)",
        validator=at_least(0))
    zero_stage: int | None = option(
        None, help="ZeRO stage 0-3 (default: the JSON's zero_optimization.stage, else 2 as in Accelerate)",
        validator=between(0, 3))
    is_train_batch_min: bool = option(
        True, help="with train and eval dataloaders, size train_micro_batch_size_per_gpu from the smaller batch size "
                   "(true) or the larger (false)")
    auto_wrap_policy: Any = option(
        None, help="accepted for compatibility, no effect: ZeRO partitions parameters itself and wraps no modules")
    offload_optimizer_device: str | None = option(
        None, help="none, cpu, nvme: where ZeRO keeps optimizer state (default: the JSON's, else none)",
        choices=OFFLOAD_DEVICES, normalize=_lower, converter=_lower, validator=_offload_device)
    offload_param_device: str | None = option(
        None, help="none, cpu, nvme: where ZeRO-3 keeps parameters (default: the JSON's, else none)",
        choices=OFFLOAD_DEVICES, normalize=_lower, converter=_lower, validator=_offload_device)
    offload_optimizer_nvme_path: str | None = option(
        None, help="directory for optimizer state offloaded to nvme", normalize=_optional_text,
        converter=_optional_text)
    offload_param_nvme_path: str | None = option(
        None, help="directory for parameters offloaded to nvme", normalize=_optional_text, converter=_optional_text)
    zero3_init_flag: bool = option(
        False, help="construct the model under deepspeed.zero.Init so ZeRO-3 partitions parameters as they are "
                    "created (needs zero_stage 3)")
    zero3_save_16bit_model: bool = option(
        False, help="ZeRO-3: gather a 16-bit model when saving (fills zero_optimization."
                    "stage3_gather_16bit_weights_on_model_save)")
    deepspeed_multinode_launcher: str | None = option(
        None, help="accepted only as 'standard': run `torchrig launch` on each machine", normalize=_lower,
        converter=_lower, validator=_launcher)
    deepspeed_hostfile: str | None = option(
        None, help="not supported (pdsh/MPI launchers): run `torchrig launch` on each machine",
        normalize=_optional_text, converter=_optional_text, validator=_hostfile)
    deepspeed_exclusion_filter: str | None = option(
        None, help="not supported (pdsh/MPI launchers)", normalize=_optional_text, converter=_optional_text,
        validator=_hostfile)
    deepspeed_inclusion_filter: str | None = option(
        None, help="not supported (pdsh/MPI launchers)", normalize=_optional_text, converter=_optional_text,
        validator=_hostfile)
    deepspeed_moe_layer_cls_names: list[str] | None = option(
        None, help="Mixture-of-Experts layer class names (comma-separated) that ZeRO-3 treats as leaf modules",
        aliases=("transformer_moe_cls_names",), normalize=class_names, converter=class_names)
    force_ds_cpu_optimizer: bool = option(
        False, help="DeepSpeed's zero_force_ds_cpu_optimizer: with CPU offload, refuse a torch optimizer and demand "
                    "DeepSpeedCPUAdam. Off by default (DeepSpeed's default is on): torchrig lets a script's own torch "
                    "optimizer run with offload. The JSON's zero_force_ds_cpu_optimizer wins when present",
        aliases=("zero_force_ds_cpu_optimizer",))
    jit_lock_warning_seconds: float = option(
        60.0, help="torchrig's own: a rank waiting this long on a compile lock of one of DeepSpeed's JIT-built ops "
                   "while nothing is being compiled says so on stderr and in its status, naming the lock file (a "
                   "killed compile leaves it behind; the wait would be silent and endless)", validator=at_least(0.1))

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed configuration as a dict (Accelerate's ``deepspeed_config``): the JSON of
        ``hf_ds_config`` as written, ``"auto"`` values included, or without one what these fields
        say; once a model is prepared, the configuration its engine was built with (every
        ``"auto"`` filled). The same dict object throughout, so scripts may keep a reference."""
        key = id(self)
        found = _CONFIG_DICTS.get(key)
        if found is None:
            found = _CONFIG_DICTS[key] = self._declared_config()
            weakref.finalize(self, _CONFIG_DICTS.pop, key, None)
        return found

    def _declared_config(self) -> dict[str, Any]:
        if self.hf_ds_config is not None:
            return copy.deepcopy(dict(load_deepspeed_json(self.hf_ds_config).data))
        zero: dict[str, Any] = {"stage": self.zero_stage if self.zero_stage is not None else "auto"}
        for kind in ("optimizer", "param"):
            device = getattr(self, f"offload_{kind}_device")
            if device not in (None, "none"):
                zero[f"offload_{kind}"] = {"device": device, "nvme_path": getattr(self, f"offload_{kind}_nvme_path")}
        zero["stage3_gather_16bit_weights_on_model_save"] = self.zero3_save_16bit_model
        ds_json: dict[str, Any] = {
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps or "auto",
            "zero_optimization": zero,
        }
        if self.gradient_clipping is not None:
            ds_json["gradient_clipping"] = self.gradient_clipping
        return ds_json

    def adopt_engine_config(self, engine_json: dict[str, Any]) -> dict[str, Any]:
        """Make :attr:`deepspeed_config` show ``engine_json`` (the first engine's DeepSpeed JSON,
        filled) and return the shared dict, which the strategy keeps using so later corrections show too."""
        shared = self.deepspeed_config
        if shared is not engine_json:
            shared.clear()
            shared.update(engine_json)
        return shared


__all__ = ["OFFLOAD_DEVICES", "STANDARD_LAUNCHER", "DeepSpeedPlugin"]
