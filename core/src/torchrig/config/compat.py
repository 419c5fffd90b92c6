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


# -- the flags of `accelerate launch` ------------------------------------------------------------


@attrs.frozen
class AccelerateFlag:
    """A flag of Accelerate's ``accelerate launch`` that torchrig's core has no flag of its own for
    (an installed plugin may: then the plugin's flag is used and this entry is not)."""

    #: Accelerate's spelling with underscores; its dash spelling is accepted too.
    flag: str
    #: ``"config"``: sets the torchrig key ``target`` (``const`` for a switch); a key of a plugin's
    #: section whose plugin is absent gives that section's install hint, or the ``strategy``'s error.
    #: ``"key"``: sets the Accelerate config key ``target`` of :data:`ACCELERATE_KEYS` (its note, its
    #: accepted values). ``"applied"``: the launcher applies it (``note`` says how). ``"no_effect"``:
    #: accepted with ``note``. ``"rejected"``: refused with ``note`` unless ``accepts`` the value.
    status: str
    target: str | None = None
    note: str = ""
    #: Whether the flag takes a value (else it is a switch: True, or ``const``).
    takes_value: bool = False
    const: Any = True
    #: ``"rejected"`` flags: values accepted anyway (with the note), e.g. a size of 1.
    accepts: Callable[[Any], bool] = _off
    #: Plugin-owned flags: the Accelerate ``distributed_type`` whose plugin reads them (its absence
    #: is reported exactly as ``--strategy`` reports it).
    strategy: str | None = None
    #: May be given several times (Accelerate's ``append`` flags).
    repeated: bool = False
    #: ``"config"`` flags: only a default for ``target`` — another flag that sets it wins (Accelerate's
    #: ``--multi_gpu --use_fsdp`` is FSDP on several GPUs, not a conflict).
    gives_way: bool = False


def _value_flags(status: str, names: str, target: str | None = None, *, prefix: str = "",
                 **kwargs: Any) -> list[AccelerateFlag]:
    """``--{prefix}{name}`` for each name, each taking a value and setting ``target.format(name=name)``."""
    return [AccelerateFlag(f"--{prefix}{name}", status, target.format(name=name) if target else None,
                           takes_value=True, **kwargs) for name in names.split()]


_DEEPSPEED_LAUNCHER = ("torchrig starts DeepSpeed's ranks with torch elastic, not DeepSpeed's launcher: run "
                       "`torchrig launch --num_machines N --machine_rank R --main_process_ip IP` on each machine, "
                       "or hand off with --cluster slurm / --cluster mpi (docs/launch.md)")
_MEGATRON = "megatron_lm_config"
_SEQUENCE_PARALLEL = ("Accelerate's sequence parallelism (DeepSpeed ALST/Ulysses) is not supported; torchrig's "
                      "tensor-parallel plan shards sequences with SequenceParallel styles (docs/parallelism.md)")

ACCELERATE_LAUNCH_FLAGS: tuple[AccelerateFlag, ...] = (
    AccelerateFlag("--quiet", "no_effect", note="torchrig's failure summary already shows only the failing rank's "
                   "traceback, never the launcher's own stack"),
    AccelerateFlag("--multi_gpu", "config", "strategy", const="MULTI_GPU", gives_way=True,
                   note="selects the data-parallel strategy (distributed_type MULTI_GPU), on the detected device, "
                        "unless another flag names the strategy (--use_fsdp, --use_deepspeed, --strategy)"),
    AccelerateFlag("--tpu", "rejected", note=_TPU),
    AccelerateFlag("--num_cpu_threads_per_process", "applied", takes_value=True,
                   note="OMP_NUM_THREADS of every rank (it overrides the launcher's environment, as in Accelerate)"),
    # A switch given is "on", which the config key refuses in a file (where "off" is what Accelerate writes);
    # on the command line it is a habit, accepted with the key's note.
    AccelerateFlag("--enable_cpu_affinity", "no_effect", note=BY_KEY["enable_cpu_affinity"].note),
    AccelerateFlag("--use_deepspeed", "config", "strategy", const="DEEPSPEED", strategy="DEEPSPEED"),
    AccelerateFlag("--use_fsdp", "config", "strategy", const="FSDP", strategy="FSDP"),
    AccelerateFlag("--use_parallelism_config", "no_effect",
                   note="torchrig builds the device mesh from parallelism_config whenever one of its sizes is set"),
    AccelerateFlag("--use_megatron_lm", "key", _MEGATRON),
    AccelerateFlag("--same_network", "key", "same_network"),
    AccelerateFlag("--role", "no_effect", takes_value=True,
                   note="torch elastic's worker role name; torchrig's logs name each worker by rank"),
    AccelerateFlag("--rdzv_conf", "applied", takes_value=True,
                   note="extra rendezvous options for torch elastic (key=value,...), as torchrun's --rdzv_conf"),
    AccelerateFlag("--tpu_cluster", "key", "tpu_use_cluster"),
    AccelerateFlag("--no_tpu_cluster", "key", "tpu_use_cluster", const=False),
    AccelerateFlag("--tpu_use_sudo", "key", "tpu_use_sudo"),
    AccelerateFlag("--vm", "key", "tpu_vm", takes_value=True, repeated=True),
    AccelerateFlag("--env", "key", "tpu_env", takes_value=True, repeated=True),
    AccelerateFlag("--main_training_function", "key", "main_training_function", takes_value=True),
    AccelerateFlag("--downcast_bf16", "key", "downcast_bf16"),
    # DeepSpeed: the plugin's own flags when it is installed.
    AccelerateFlag("--deepspeed_config_file", "config", "deepspeed_config.deepspeed_config_file", takes_value=True,
                   strategy="DEEPSPEED"),
    *_value_flags("config", "zero_stage offload_optimizer_device offload_param_device offload_optimizer_nvme_path "
                  "offload_param_nvme_path gradient_clipping zero3_init_flag zero3_save_16bit_model "
                  "deepspeed_moe_layer_cls_names", "deepspeed_config.{name}", strategy="DEEPSPEED"),
    AccelerateFlag("--deepspeed_hostfile", "rejected", takes_value=True, note=_DEEPSPEED_LAUNCHER),
    AccelerateFlag("--deepspeed_exclusion_filter", "rejected", takes_value=True,
                   note=_DEEPSPEED_LAUNCHER + "; choose GPUs with --gpu_ids"),
    AccelerateFlag("--deepspeed_inclusion_filter", "rejected", takes_value=True,
                   note=_DEEPSPEED_LAUNCHER + "; choose GPUs with --gpu_ids"),
    AccelerateFlag("--deepspeed_multinode_launcher", "no_effect", takes_value=True, note=_DEEPSPEED_LAUNCHER),
    # FSDP: the plugin's own flags when it is installed.
    *_value_flags("config", "fsdp_version fsdp_offload_params fsdp_min_num_params fsdp_sharding_strategy "
                  "fsdp_reshard_after_forward fsdp_auto_wrap_policy fsdp_transformer_layer_cls_to_wrap "
                  "fsdp_backward_prefetch fsdp_state_dict_type fsdp_forward_prefetch fsdp_use_orig_params "
                  "fsdp_cpu_ram_efficient_loading fsdp_sync_module_states fsdp_activation_checkpointing",
                  "fsdp_config.{name}", strategy="FSDP"),
    AccelerateFlag("--fsdp_activation_checkpointing_offload", "config", "fsdp_config.activation_offload",
                   takes_value=True, strategy="FSDP"),
    *_value_flags("key", " ".join(
        f"megatron_lm_{name}" for name in (
            "tp_degree use_custom_fsdp no_load_optim eod_mask_loss overlap_cpu_optimizer_d2h_h2d no_save_optim "
            "optimizer_cpu_offload use_precision_aware_optimizer decoder_last_pipeline_num_layers pp_degree "
            "num_micro_batches sequence_parallelism recompute_activations use_distributed_optimizer "
            "gradient_clipping recompute_granularity recompute_method recompute_num_layers attention_backend "
            "expert_model_parallel_size context_parallel_size attention_dropout hidden_dropout "
            "attention_softmax_in_fp32 expert_tensor_parallel_size calculate_per_token_loss "
            "use_rotary_position_embeddings").split()), _MEGATRON),
    # fp8: the fp8 precision plugin's section (it refuses TransformerEngine/MS-AMP options by name).
    *_value_flags("config", "backend margin interval amax_history_len amax_compute_algo override_linear_precision "
                  "opt_level enable_fsdp_float8_all_gather pad_inner_dim", "fp8_config.{name}", prefix="fp8_"),
    AccelerateFlag("--fp8_format", "config", "fp8_config.fp8_format", takes_value=True),
    AccelerateFlag("--fp8_use_autocast_during_eval", "config", "fp8_config.use_autocast_during_eval"),
    *_value_flags("rejected", "aws_access_key_id aws_secret_access_key", note=_SAGEMAKER),
    AccelerateFlag("--debug", "no_effect", note=BY_KEY["debug"].note),
    AccelerateFlag("--mpirun_hostfile", "key", "mpirun_config", takes_value=True),
    *_value_flags("config", "dp_replicate_size dp_shard_size tp_size cp_size cp_comm_strategy",
                  "parallelism_config.{name}", prefix="parallelism_config_"),
    AccelerateFlag("--parallelism_config_cp_backend", "rejected", takes_value=True,
                   note="context parallelism runs on torch's own implementation (backend 'torch' only)",
                   accepts=lambda value: str(value).lower() == "torch"),
    *_value_flags("rejected", "parallelism_config_sp_size parallelism_config_sp_backend parallelism_config_sp_seq_length "
                  "parallelism_config_sp_seq_length_is_variable parallelism_config_sp_attn_implementation",
                  note=_SEQUENCE_PARALLEL, accepts=lambda value: _off(value) or str(value) == "1"),
)

__all__ = ["ACCELERATE_KEYS", "ACCELERATE_LAUNCH_FLAGS", "BY_KEY", "DISTRIBUTED_TYPE_HINTS", "AccelerateFlag",
           "AccelerateKey"]
