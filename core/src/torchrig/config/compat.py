"""Every key of Hugging Face Accelerate's config files, and what torchrig does with it.

Nothing is dropped silently: a key is *supported* (read into torchrig's configuration),
*accepted with no effect* (only with the value Accelerate writes when the feature is off, with
the reason), or *rejected* with the reason. docs/configuration.md shows this table; a test
loads every key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


def _off(value: Any) -> bool:
    """The value Accelerate writes when a feature is unused."""
    return value in (None, False, "", "no", "NO", "none", "None", {}, [], 0) or (
        isinstance(value, dict) and all(_off(v) for v in value.values())
    )


def _always(value: Any) -> bool:
    return True


@attrs.frozen
class AccelerateKey:
    key: str
    #: ``"supported"``, ``"no_effect"`` or ``"rejected"``.
    status: str
    #: Supported keys: the torchrig key they set. Others: why they have no effect / are refused.
    note: str
    #: For ``no_effect`` keys: which values are accepted (others are refused with ``note``).
    accepts: Callable[[Any], bool] = _always
    #: For keys served by an optional plugin: the pip requirement that provides it.
    install_hint: str | None = None


_TPU = "TPUs are not supported by torchrig"
_SAGEMAKER = "launching on Amazon SageMaker is not supported; run `torchrig launch` on the instances"

ACCELERATE_KEYS: tuple[AccelerateKey, ...] = (
    AccelerateKey("compute_environment", "no_effect", "only LOCAL_MACHINE exists in torchrig; " + _SAGEMAKER,
                  accepts=lambda v: v in ("LOCAL_MACHINE", None)),
    AccelerateKey("distributed_type", "supported", "strategy (NO: single; MULTI_CPU/MULTI_GPU...: the data-parallel "
                  "strategy; FSDP; DEEPSPEED; each strategy plugin declares the values it serves)"),
    AccelerateKey("mixed_precision", "supported", "mixed_precision"),
    AccelerateKey("use_cpu", "supported", "use_cpu"),
    AccelerateKey("num_processes", "supported", "num_processes"),
    AccelerateKey("num_machines", "supported", "num_machines"),
    AccelerateKey("machine_rank", "supported", "machine_rank"),
    AccelerateKey("main_process_ip", "supported", "main_process_ip"),
    AccelerateKey("main_process_port", "supported", "main_process_port"),
    AccelerateKey("rdzv_backend", "supported", "rdzv_backend"),
    AccelerateKey("gpu_ids", "supported", "gpu_ids"),
    AccelerateKey("dynamo_config", "supported", "dynamo_config (TorchDynamoPlugin)"),
    AccelerateKey("dynamo_backend", "supported", "dynamo_config.backend (older Accelerate files)"),
    AccelerateKey("fsdp_config", "supported", "fsdp_config (the fsdp strategy plugin's section)",
                  install_hint="torchrig[fsdp]"),
    AccelerateKey("deepspeed_config", "supported", "deepspeed_config (the deepspeed strategy plugin's section)",
                  install_hint="torchrig[deepspeed]"),
    AccelerateKey("downcast_bf16", "no_effect", "only affects TPUs in Accelerate"),
    AccelerateKey("same_network", "no_effect", "torchrig's c10d rendezvous works the same whether or not machines share a network"),
    AccelerateKey("main_training_function", "no_effect", "used only by Accelerate's notebook launcher"),
    AccelerateKey("debug", "no_effect", "Accelerate's debug mode checks collective shapes; torchrig's collectives "
                  "always handle uneven shapes and name the failing rank", accepts=_off),
    AccelerateKey("enable_cpu_affinity", "no_effect", "pinning CPU affinity to GPUs is not implemented", accepts=_off),
    AccelerateKey("use_mps_device", "no_effect", "MPS is auto-detected; set device: mps to force it", accepts=_off),
    AccelerateKey("fp8_config", "supported", "fp8_config (the fp8 precision plugin's section: backend AO with "
                  "torchao's recipes; TransformerEngine and MS-AMP keys are refused by name)",
                  install_hint="torchrig[fp8]"),
    AccelerateKey("megatron_lm_config", "no_effect", "Megatron-LM is not supported", accepts=_off),
    AccelerateKey("parallelism_config", "supported", "parallelism_config (ParallelismConfig: the device mesh; "
                  "parallelism_config_<axis>_size keys accepted)"),
    AccelerateKey("ipex_config", "no_effect", "Intel Extension for PyTorch is not supported", accepts=_off),
    AccelerateKey("mpirun_config", "no_effect", "Accelerate's mpirun options are not read; `torchrig launch --cluster mpi` "
                  "hands off to mpirun with the `mpi` section (docs/clusters.md)",
                  accepts=_off),
    AccelerateKey("tpu_name", "no_effect", _TPU, accepts=_off),
    AccelerateKey("tpu_zone", "no_effect", _TPU, accepts=_off),
    AccelerateKey("tpu_use_cluster", "no_effect", _TPU, accepts=_off),
    AccelerateKey("tpu_use_sudo", "no_effect", _TPU, accepts=_off),
    AccelerateKey("tpu_vm", "no_effect", _TPU, accepts=_off),
    AccelerateKey("tpu_env", "no_effect", _TPU, accepts=_off),
    AccelerateKey("command_file", "no_effect", _TPU + " (TPU pod commands)", accepts=_off),
    AccelerateKey("commands", "no_effect", _TPU + " (TPU pod commands)", accepts=_off),
    *(
        AccelerateKey(key, "rejected", _SAGEMAKER)
        for key in ("ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
                    "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
                    "sagemaker_metrics_file", "additional_args")
    ),
)

BY_KEY: dict[str, AccelerateKey] = {entry.key: entry for entry in ACCELERATE_KEYS}

#: Accelerate ``distributed_type`` values served by first-party plugins, for the error message
#: when the plugin is not installed (installed plugins declare their own values).
DISTRIBUTED_TYPE_HINTS: dict[str, str] = {
    "MULTI_CPU": "torchrig-ddp",
    "MULTI_GPU": "torchrig-ddp",
    "MULTI_NPU": "torchrig-ddp",
    "MULTI_XPU": "torchrig-ddp",
    "MULTI_MLU": "torchrig-ddp",
    "MULTI_MUSA": "torchrig-ddp",
    "MULTI_HPU": "torchrig-ddp",
    "FSDP": "torchrig[fsdp]",
    "DEEPSPEED": "torchrig[deepspeed]",
}

__all__ = ["ACCELERATE_KEYS", "BY_KEY", "DISTRIBUTED_TYPE_HINTS", "AccelerateKey"]
