"""The declared table: every public name of Accelerate's modules, and what torchrig does with it.

Generated from Accelerate 1.15.0 itself (the released wheel): ``tests/compat/data/gen_accelerate_names.py``
imports each module (``accelerate``, ``accelerate.utils`` and the ten mirrored modules ``state``,
``launchers``, ``data_loader``, ``optimizer``, ``scheduler``, ``tracking``, ``checkpointing``,
``local_sgd``, ``logging``, ``big_modeling``) and lists every name its ``dir()`` shows — names it
imports from elsewhere too, since scripts import them from there — leaving out private names, modules
and standard-library plumbing (the rule is written in the generator). ``tests/compat/test_accelerate_names.py``
checks that this table has exactly those names; ``tests/compat/test_accelerate_namespaces.py`` that every
mirrored module answers each of them.

Keys are Accelerate's module paths; under ``torchrig`` the same path answers
(``accelerate.utils.operations`` → ``torchrig.utils.operations``). Values (see
:mod:`torchrig.compat.targets`): ``"module:attribute"`` (torchrig's object, or torch's or safetensors'
own where Accelerate re-exports one), :class:`FromPlugin`
(a plugin's export) or :class:`Refused` (why not, and what to use). Torch-free: plain data.
"""

from __future__ import annotations

from torchrig.compat.targets import FromPlugin, Refused, Target

#: The Accelerate release the table was generated from.
ACCELERATE_SOURCE = "accelerate 1.15.0 (the released wheel)"

# -- refusals shared by families of names ---------------------------------------------------------

BIG_MODEL_INFERENCE = Refused(
    "big-model inference (device maps, CPU/disk offload hooks, dispatching one model across devices) is not part of "
    "torchrig, a training framework",
    "accelerate's big_modeling or transformers' from_pretrained(device_map=...) for inference; to train a model "
    "larger than one device, shard it with the fsdp or deepspeed strategy")
MEGATRON = Refused("Megatron-LM is not supported",
                   "the fsdp or deepspeed strategy for sharded training")
XLA = Refused("TPU/XLA devices are not supported (there is no torch_xla device plugin)",
              "a CUDA or CPU device; a third-party device plugin can add one (docs/plugins.md)")
TRANSFORMER_ENGINE = Refused("NVIDIA TransformerEngine fp8 is not supported",
                             "fp8 through torchao: mixed_precision: fp8 with AORecipeKwargs (torchrig[fp8], "
                             "docs/precision.md)")
MS_AMP = Refused("MS-AMP is not supported", "fp8 through torchao: mixed_precision: fp8 with AORecipeKwargs "
                 "(torchrig[fp8], docs/precision.md)")
BITSANDBYTES = Refused("loading bitsandbytes-quantized models is not part of torchrig",
                       "transformers' from_pretrained(quantization_config=BitsAndBytesConfig(...))")
SAGEMAKER = Refused("launching on Amazon SageMaker is not supported",
                    "`torchrig launch` on the instances, or a cluster plugin (docs/plugins.md)")
LAUNCH_INTERNAL = Refused("an internal helper of `accelerate launch`",
                          "`torchrig launch` (docs/launch.md) or torchrig.notebook_launcher")
FSDP_INTERNAL = Refused(
    "an internal step of Accelerate's FSDP integration",
    "the fsdp strategy does this itself in prepare(), save_state() and load_state() (docs/fsdp.md); "
    "merge_fsdp_weights or `torchrig merge-weights` for full weights")
DEEPSPEED_INTERNAL = Refused(
    "an internal part of Accelerate's DeepSpeed integration",
    "the deepspeed strategy's prepared objects: the model, optimizer and scheduler accelerator.prepare() returns "
    "(docs/deepspeed.md)")
CONTEXT_PARALLEL = Refused(
    "Accelerate's context-parallel handler class is not provided (its settings are parallelism_config keys)",
    "ParallelismConfig(cp_size=N, cp_comm_strategy='allgather'|'alltoall', cp_load_balance=True) and "
    "accelerator.maybe_context_parallel(...) (GPU only; docs/parallelism.md)")
ASYNC_TP = Refused(
    "Accelerate's tensor-parallel handler class is not provided (async TP is a parallelism_config key)",
    "ParallelismConfig(tp_size=N, tp_plan=..., async_tp=True) (GPU and torch.compile only; docs/parallelism.md)")
DEEPSPEED_SEQUENCE_PARALLEL = Refused("DeepSpeed-Ulysses/ALST sequence parallelism is not supported",
                                      "FullyShardedDataParallelPlugin or DeepSpeedPlugin without sequence parallelism")
CHECKPOINT_INTERNAL = Refused(
    "an internal step of Accelerate's save_state/load_state",
    "accelerator.save_state()/load_state(), which commit and load everything as one checkpoint, and "
    "accelerator.register_for_checkpointing() for your own objects (docs/checkpoints.md)")
FP8_PLUGIN = "the fp8 precision plugin on torchao (mixed_precision: fp8): pip install 'torchrig[fp8]'"


def _tracker(name: str) -> FromPlugin:
    return FromPlugin(name, f"a tracker plugin exporting {name} (torchrig's first-party trackers are csv, jsonl, "
                            "tensorboard, wandb and mlflow in torchrig-trackers: pip install 'torchrig[trackers]'; "
                            "for another service write a tracker plugin — `torchrig new-plugin NAME tracker`, "
                            "docs/plugins.md — or pass a torchrig.tracking.GeneralTracker subclass instance in log_with)")


# -- accelerate.utils, by the submodule that defines each name --------------------------------------

UTILS_CONSTANTS: dict[str, Target] = {
    name: f"torchrig.utils.constants:{name}" for name in (
        "MODEL_NAME", "OPTIMIZER_NAME", "PROFILE_PATTERN_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME",
        "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "SAMPLER_NAME", "SCALER_NAME",
        "SCHEDULER_NAME", "TORCH_DISTRIBUTED_OPERATION_TYPES", "TORCH_LAUNCH_PARAMS", "WEIGHTS_INDEX_NAME",
        "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME")
}
UTILS_CONSTANTS.update({
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": Refused("MTIA profiling is not supported", "CPU/CUDA profiling "
                                                        "through accelerator.profile()"),
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": Refused("Intel XPU devices are not supported (no xpu device plugin)",
                                                       "CPU/CUDA profiling through accelerator.profile()"),
})

UTILS_DATACLASSES: dict[str, Target] = {
    "AutocastKwargs": "torchrig.config.options:AutocastKwargs",
    "DataLoaderConfiguration": "torchrig.config.options:DataLoaderConfiguration",
    "GradientAccumulationPlugin": "torchrig.config.options:GradientAccumulationPlugin",
    "GradScalerKwargs": "torchrig.config.options:GradScalerKwargs",
    "InitProcessGroupKwargs": "torchrig.config.options:InitProcessGroupKwargs",
    "KwargsHandler": "torchrig.config.options:KwargsHandler",
    "ProfileKwargs": "torchrig.config.options:ProfileKwargs",
    "ProjectConfiguration": "torchrig.config.options:ProjectConfiguration",
    "TorchDynamoPlugin": "torchrig.config.options:TorchDynamoPlugin",
    "ComputeEnvironment": "torchrig.compat.enums:ComputeEnvironment",
    "CustomDtype": "torchrig.compat.enums:CustomDtype",
    "DistributedType": "torchrig.compat.enums:DistributedType",
    "DynamoBackend": "torchrig.compat.enums:DynamoBackend",
    "LoggerType": "torchrig.compat.enums:LoggerType",
    "PrecisionType": "torchrig.compat.enums:PrecisionType",
    "RNGType": "torchrig.compat.enums:RNGType",
    "TensorInformation": "torchrig.distributed.nested:TensorInformation",
    "DDPCommunicationHookType": FromPlugin("DDPCommunicationHookType", "torchrig-ddp (pip install torchrig)"),
    "DistributedDataParallelKwargs": FromPlugin("DistributedDataParallelKwargs", "torchrig-ddp (pip install torchrig)"),
    "DeepSpeedPlugin": FromPlugin("DeepSpeedPlugin", "pip install 'torchrig[deepspeed]'"),
    "FullyShardedDataParallelPlugin": FromPlugin("FullyShardedDataParallelPlugin", "pip install 'torchrig[fsdp]'"),
    "FP8RecipeKwargs": FromPlugin("FP8RecipeKwargs", FP8_PLUGIN),
    "AORecipeKwargs": FromPlugin("AORecipeKwargs", FP8_PLUGIN),
    "TERecipeKwargs": TRANSFORMER_ENGINE,
    "MSAMPRecipeKwargs": MS_AMP,
    "BnbQuantizationConfig": BITSANDBYTES,
    "MegatronLMPlugin": MEGATRON,
    "add_model_config_to_megatron_parser": MEGATRON,
    "SageMakerDistributedType": SAGEMAKER,
    "DeepSpeedSequenceParallelConfig": DEEPSPEED_SEQUENCE_PARALLEL,
    "TorchContextParallelConfig": CONTEXT_PARALLEL,
    "TorchTensorParallelConfig": ASYNC_TP,
    "TorchTensorParallelPlugin": "torchrig.config.options:TorchTensorParallelPlugin",
}

UTILS_ENVIRONMENT: dict[str, Target] = {
    name: f"torchrig.utils.environment:{name}" for name in (
        "are_libraries_initialized", "check_cuda_fp8_capability", "check_cuda_p2p_ib_support", "clear_environment",
        "convert_dict_to_env_variables", "get_cpu_distributed_information", "get_gpu_info", "get_int_from_env",
        "parse_choice_from_env", "parse_flag_from_env", "patch_environment", "purge_accelerate_environment",
        "str_to_bool")
}
UTILS_ENVIRONMENT["get_current_device_type"] = "torchrig.utils.imports:get_current_device_type"
UTILS_ENVIRONMENT["set_numa_affinity"] = Refused("torchrig does not pin processes to NUMA nodes",
                                                 "numactl, or torchrun's --numa-binding")

UTILS_IMPORTS: dict[str, Target] = {
    name: f"torchrig.utils.imports:{name}" for name in (
        "deepspeed_required", "is_4bit_bnb_available", "is_8bit_bnb_available", "is_aim_available",
        "is_amdsmi_available", "is_bf16_available", "is_bitsandbytes_multi_backend_available", "is_bnb_available",
        "is_boto3_available", "is_clearml_available", "is_comet_ml_available", "is_cuda_available",
        "is_datasets_available", "is_deepspeed_available", "is_dvclive_available", "is_fp8_available",
        "is_fp16_available", "is_habana_gaudi1", "is_hpu_available", "is_import_timer_available", "is_lomo_available",
        "is_matplotlib_available", "is_megatron_lm_available", "is_mlflow_available", "is_mlu_available",
        "is_mps_available", "is_msamp_available", "is_musa_available", "is_neuron_available", "is_npu_available",
        "is_pandas_available", "is_peft_available", "is_pippy_available", "is_pynvml_available",
        "is_pytest_available", "is_rich_available", "is_rocm_available", "is_sagemaker_available",
        "is_schedulefree_available", "is_sdaa_available", "is_swanlab_available", "is_tensorboard_available",
        "is_timm_available", "is_torch_xla_available", "is_torchao_available", "is_torchdata_available",
        "is_torchdata_stateful_dataloader_available", "is_torchvision_available", "is_trackio_available",
        "is_transformer_engine_available", "is_transformer_engine_mxfp8_available", "is_transformers_available",
        "is_triton_available", "is_wandb_available", "is_weights_only_available", "is_xccl_available",
        "is_xpu_available", "torchao_required")
}

UTILS_MODELING: dict[str, Target] = {
    name: f"torchrig.utils.modeling:{name}" for name in (
        "align_module_device", "calculate_maximum_sizes", "check_tied_parameters_in_config", "compute_module_sizes",
        "convert_file_size_to_int", "dtype_byte_size", "find_tied_parameters", "get_grad_scaler",
        "get_max_layer_size", "get_mixed_precision_context_manager", "id_tensor_storage", "is_peft_model",
        "load_checkpoint_in_model",
        "load_state_dict", "named_module_tensors", "retie_parameters", "set_module_tensor_to_device")
}
UTILS_MODELING.update({name: BIG_MODEL_INFERENCE for name in (
    "check_device_map", "check_tied_parameters_on_same_device", "get_balanced_memory", "get_max_memory", "has_offloaded_params", "infer_auto_device_map", "load_offloaded_weights")})

UTILS_OFFLOAD: dict[str, Target] = {name: BIG_MODEL_INFERENCE for name in (
    "OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
    "offload_state_dict", "offload_weight", "save_offload_index")}

UTILS_OPERATIONS: dict[str, Target] = {
    name: f"torchrig.distributed.nested:{name}" for name in (
        "CannotPadNestedTensorWarning", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32", "find_batch_size",
        "find_device", "get_data_structure", "honor_type", "ignorant_find_batch_size", "initialize_tensors",
        "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify", "pad_input_tensors",
        "recursively_apply", "send_to_device", "slice_tensors")
}
UTILS_OPERATIONS.update({
    name: f"torchrig.utils.operations:{name}" for name in (
        "broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather", "gather_object",
        "pad_across_processes", "reduce")
})
UTILS_OPERATIONS["GatheredParameters"] = FromPlugin(
    "GatheredParameters", "the deepspeed strategy (ZeRO-3 parameter gathering)",
    fallback="torchrig.utils.operations:no_parameter_gathering")

UTILS_VERSIONS: dict[str, Target] = {
    "compare_versions": "torchrig.utils.versions:compare_versions",
    "is_torch_version": "torchrig.utils.versions:is_torch_version",
}

UTILS_DEEPSPEED: dict[str, Target] = {
    "DummyOptim": FromPlugin("DummyOptim", "pip install 'torchrig[deepspeed]'"),
    "DummyScheduler": FromPlugin("DummyScheduler", "pip install 'torchrig[deepspeed]'"),
    "get_active_deepspeed_plugin": FromPlugin("get_active_deepspeed_plugin", "pip install 'torchrig[deepspeed]'"),
    "DeepSpeedEngineWrapper": DEEPSPEED_INTERNAL,
    "DeepSpeedOptimizerWrapper": DEEPSPEED_INTERNAL,
    "DeepSpeedSchedulerWrapper": DEEPSPEED_INTERNAL,
    "map_pytorch_optim_to_deepspeed": DEEPSPEED_INTERNAL,
    "HfDeepSpeedConfig": Refused("transformers' hook for ZeRO-3 initialisation inside from_pretrained",
                                 "transformers.integrations.HfDeepSpeedConfig"),
}

UTILS_BNB: dict[str, Target] = {"has_4bit_bnb_layers": BITSANDBYTES, "load_and_quantize_model": BITSANDBYTES}

UTILS_FSDP: dict[str, Target] = {name: FSDP_INTERNAL for name in (
    "disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading", "ensure_weights_retied",
    "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters", "get_fsdp2_grad_scaler", "load_fsdp_model", "load_fsdp_optimizer",
    "save_fsdp_model", "save_fsdp_optimizer")}
UTILS_FSDP["merge_fsdp_weights"] = FromPlugin("merge_fsdp_weights", "pip install 'torchrig[fsdp]'")

UTILS_LAUNCH: dict[str, Target] = {name: LAUNCH_INTERNAL for name in (
    "PrepareForLaunch", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env")}
UTILS_LAUNCH.update({"prepare_sagemager_args_inputs": SAGEMAKER, "prepare_tpu": XLA})

UTILS_MEGATRON: dict[str, Target] = {name: MEGATRON for name in (
    "AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "MegatronLMDummyDataLoader", "MegatronLMDummyScheduler",
    "T5TrainStep", "avg_losses_across_data_parallel_group", "MegatronEngine", "MegatronLMOptimizerWrapper",
    "MegatronLMSchedulerWrapper", "gather_across_data_parallel_groups", "megatron_lm_initialize",
    "megatron_lm_prepare_data_loader", "megatron_lm_prepare_model_optimizer_scheduler",
    "megatron_lm_prepare_optimizer", "megatron_lm_prepare_scheduler")}

UTILS_MEMORY: dict[str, Target] = {
    "find_executable_batch_size": "torchrig.utils.memory:find_executable_batch_size",
    "release_memory": "torchrig.utils.memory:release_memory",
}

UTILS_OTHER: dict[str, Target] = {
    "check_os_kernel": "torchrig.utils.environment:check_os_kernel",
    "is_port_in_use": "torchrig.utils.environment:is_port_in_use",
    "clean_state_dict_for_safetensors": "torchrig.utils.modeling:clean_state_dict_for_safetensors",
    "extract_model_from_parallel": "torchrig.utils.modeling:extract_model_from_parallel",
    "get_module_children_bottom_up": "torchrig.utils.modeling:get_module_children_bottom_up",
    "model_has_dtensor": "torchrig.utils.modeling:model_has_dtensor",
    "get_model_tp_size": "torchrig.utils.modeling:get_model_tp_size",
    "recursive_getattr": "torchrig.utils.modeling:recursive_getattr",
    "compile_regions": "torchrig.training.compile:compile_regions",
    "has_compiled_regions": "torchrig.training.compile:has_compiled_regions",
    "is_compiled_module": "torchrig.training.compile:is_compiled_module",
    "convert_bytes": "torchrig.utils.memory:convert_bytes",
    "get_pretty_name": "torchrig.logging:get_pretty_name",
    "merge_dicts": "torchrig.distributed.nested:merge_dicts",
    "load": "torchrig.utils.serialization:load",
    "save": "torchrig.utils.serialization:save",
    "wait_for_everyone": "torchrig.utils.operations:wait_for_everyone",
    "write_basic_config": "torchrig.config.default_file:write_basic_config",
    "compile_regions_deepspeed": Refused("Accelerate's hook for regional compilation inside a DeepSpeed engine",
                                        "TorchDynamoPlugin(use_regional_compilation=True): torchrig compiles after the "
                                        "strategy wrapped the model, under every strategy"),
    "compile_regions_fsdp2": Refused("Accelerate's hook for regional compilation under FSDP2",
                                    "TorchDynamoPlugin(use_regional_compilation=True): torchrig compiles after the "
                                    "strategy wrapped the model, under every strategy"),
}

UTILS_RANDOM: dict[str, Target] = {
    "set_seed": "torchrig.utils.random:set_seed",
    "synchronize_rng_state": "torchrig.utils.random:synchronize_rng_state",
    "synchronize_rng_states": "torchrig.utils.random:synchronize_rng_states",
}

UTILS_MISC: dict[str, Target] = {
    "ParallelismConfig": "torchrig.config.options:ParallelismConfig",
    "convert_model_to_fp8_ao": FromPlugin("convert_model_to_fp8_ao", FP8_PLUGIN),
    "filter_first_and_last_linear_layers": FromPlugin("filter_first_and_last_linear_layers", FP8_PLUGIN),
    "has_ao_layers": FromPlugin("has_ao_layers", FP8_PLUGIN),
    "install_xla": XLA,
    "tqdm": "torchrig.utils.tqdm:tqdm",
    "apply_fp8_autowrap": TRANSFORMER_ENGINE,
    "contextual_fp8_autocast": TRANSFORMER_ENGINE,
    "convert_model": TRANSFORMER_ENGINE,
    "has_transformer_engine_layers": TRANSFORMER_ENGINE,
}

#: Accelerate's ``accelerate/utils/__init__.py`` re-exports all of these.
UTILS_SUBMODULES: dict[str, dict[str, Target]] = {
    "accelerate.utils.constants": UTILS_CONSTANTS,
    "accelerate.utils.dataclasses": UTILS_DATACLASSES,
    "accelerate.utils.environment": UTILS_ENVIRONMENT,
    "accelerate.utils.imports": UTILS_IMPORTS,
    "accelerate.utils.modeling": UTILS_MODELING,
    "accelerate.utils.offload": UTILS_OFFLOAD,
    "accelerate.utils.operations": UTILS_OPERATIONS,
    "accelerate.utils.versions": UTILS_VERSIONS,
    "accelerate.utils.deepspeed": UTILS_DEEPSPEED,
    "accelerate.utils.bnb": UTILS_BNB,
    "accelerate.utils.fsdp_utils": UTILS_FSDP,
    "accelerate.utils.launch": UTILS_LAUNCH,
    "accelerate.utils.megatron_lm": UTILS_MEGATRON,
    "accelerate.utils.memory": UTILS_MEMORY,
    "accelerate.utils.other": UTILS_OTHER,
    "accelerate.utils.random": UTILS_RANDOM,
    "accelerate.utils.tqdm": {"tqdm": "torchrig.utils.tqdm:tqdm"},
}

UTILS: dict[str, Target] = {name: target for part in UTILS_SUBMODULES.values() for name, target in part.items()}
UTILS.update(UTILS_MISC)

# -- the other modules -------------------------------------------------------------------------------

TOP_LEVEL: dict[str, Target] = {
    "Accelerator": "torchrig.accelerator:Accelerator",
    "PartialState": "torchrig.distributed.process:PartialState",
    "init_empty_weights": "torchrig.training.meta_device:init_empty_weights",
    "init_on_device": "torchrig.training.meta_device:init_on_device",
    "skip_first_batches": "torchrig.data.standalone:skip_first_batches",
    "notebook_launcher": "torchrig.launch.notebook:notebook_launcher",
    "debug_launcher": "torchrig.launch.notebook:debug_launcher",
    "load_checkpoint_in_model": "torchrig.utils.modeling:load_checkpoint_in_model",
    "cpu_offload": BIG_MODEL_INFERENCE,
    "cpu_offload_with_hook": BIG_MODEL_INFERENCE,
    "disk_offload": BIG_MODEL_INFERENCE,
    "dispatch_model": BIG_MODEL_INFERENCE,
    "load_checkpoint_and_dispatch": BIG_MODEL_INFERENCE,
    "infer_auto_device_map": BIG_MODEL_INFERENCE,
    "prepare_pippy": Refused("pipeline-parallel inference (PiPPy) is not part of torchrig",
                             "torch.distributed.pipelining directly"),
}
TOP_LEVEL.update({name: UTILS[name] for name in (
    "ParallelismConfig", "AutocastKwargs", "DataLoaderConfiguration", "DDPCommunicationHookType", "DeepSpeedPlugin",
    "DistributedDataParallelKwargs", "DistributedType", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "ProfileKwargs", "find_executable_batch_size", "is_rich_available",
    "synchronize_rng_states")})

def _same_as(home: dict[str, Target], *names: str) -> dict[str, Target]:
    """Names a module imports from another of Accelerate's modules (``from accelerate.state import
    DistributedType``): the same target as at their home path."""
    return {name: home[name] for name in names}


STATE_INTERNAL = Refused("an internal part of Accelerate's process-wide singletons (for XLA)",
                         "torchrig.state.PartialState(), which views the process's run")
LAYERWISE_CASTING = Refused("layerwise storage-dtype casting hooks (diffusers inference) are not part of torchrig",
                            "diffusers' enable_layerwise_casting()")

STATE: dict[str, Target] = {
    "PartialState": "torchrig.distributed.process:PartialState",
    "AcceleratorState": "torchrig.distributed.process:AcceleratorState",
    "GradientState": "torchrig.training.gradient_state:GradientState",
    "is_initialized": "torchrig.distributed.process:is_initialized",
    "do_nothing": "torchrig.distributed.process:do_nothing",
    "ThreadLocalSharedDict": STATE_INTERNAL,
    "SharedDict": STATE_INTERNAL,
    **_same_as(UTILS, "DistributedType", "DynamoBackend", "GradientAccumulationPlugin", "SageMakerDistributedType",
               "check_cuda_fp8_capability", "check_cuda_p2p_ib_support", "deepspeed_required",
               "get_cpu_distributed_information", "get_int_from_env", "is_datasets_available", "is_deepspeed_available",
               "is_fp8_available", "is_habana_gaudi1", "is_hpu_available", "is_mlu_available", "is_mps_available",
               "is_musa_available", "is_neuron_available", "is_npu_available", "is_sdaa_available",
               "is_torch_xla_available", "is_xccl_available", "is_xpu_available", "parse_choice_from_env",
               "parse_flag_from_env", "set_numa_affinity"),
}

LOGGING: dict[str, Target] = {
    "MultiProcessAdapter": "torchrig.logging:MultiProcessAdapter",
    "get_logger": "torchrig.logging:get_logger",
    **_same_as(STATE, "PartialState"),
}

LOCAL_SGD: dict[str, Target] = {
    "LocalSGD": "torchrig.local_sgd:LocalSGD",
    **_same_as(TOP_LEVEL, "Accelerator"),
    **_same_as(UTILS, "DistributedType"),
}

LAUNCHERS: dict[str, Target] = {
    "notebook_launcher": "torchrig.launch.notebook:notebook_launcher",
    "debug_launcher": "torchrig.launch.notebook:debug_launcher",
    "test_launch": "torchrig.launch.notebook:test_launch",
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION": Refused(
        "the torch version from which Accelerate's notebook_launcher passes a log-line prefix to torch elastic",
        "torchrig.notebook_launcher, which prefixes each rank's lines itself; torchrig.utils.is_torch_version "
        "for a version check"),
    **_same_as(STATE, "AcceleratorState", "PartialState"),
    **_same_as(UTILS, "PrecisionType", "PrepareForLaunch", "are_libraries_initialized", "check_cuda_p2p_ib_support",
               "get_current_device_type", "get_gpu_info", "is_mps_available", "is_rocm_available", "is_torch_version",
               "patch_environment"),
}

BIG_MODELING: dict[str, Target] = {
    "init_empty_weights": "torchrig.training.meta_device:init_empty_weights",
    "init_on_device": "torchrig.training.meta_device:init_on_device",
    "attach_layerwise_casting_hooks": LAYERWISE_CASTING,
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": LAYERWISE_CASTING,
    **{name: BIG_MODEL_INFERENCE for name in (
        "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch",
        # accelerate.hooks, imported by accelerate.big_modeling
        "AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook", "UserCpuOffloadHook", "add_hook_to_module",
        "attach_align_device_hook", "attach_align_device_hook_on_blocks")},
    **_same_as(UTILS, "OffloadedWeightsLoader", "check_cuda_p2p_ib_support", "check_device_map",
               "extract_submodules_state_dict", "find_tied_parameters", "get_balanced_memory", "infer_auto_device_map",
               "is_bnb_available", "is_mlu_available", "is_musa_available", "is_neuron_available", "is_npu_available",
               "is_sdaa_available", "is_xpu_available", "load_checkpoint_in_model", "offload_state_dict",
               "parse_flag_from_env", "recursive_getattr", "retie_parameters"),
}

DATA_LOADER: dict[str, Target] = {
    "SeedableRandomSampler": "torchrig.data:SeedableRandomSampler",
    "DataLoaderShard": "torchrig.data:PreparedDataLoader",
    "DataLoaderDispatcher": "torchrig.data:PreparedDataLoader",
    "SkipBatchSampler": "torchrig.data.standalone:SkipBatchSampler",
    "get_sampler": "torchrig.data.standalone:get_sampler",
    "prepare_data_loader": "torchrig.data.standalone:prepare_data_loader",
    "skip_first_batches": "torchrig.data.standalone:skip_first_batches",
    "BatchSamplerShard": Refused("torchrig shards index lists inside its prepared loader instead of wrapping batch "
                                 "samplers", "torchrig.data_loader.prepare_data_loader(dataloader, num_processes=..., "
                                 "process_index=...) or accelerator.prepare(dataloader)"),
    "IterableDatasetShard": Refused("torchrig shards iterable datasets inside its prepared loader",
                                    "torchrig.data_loader.prepare_data_loader(dataloader, num_processes=..., "
                                    "process_index=...) or accelerator.prepare(dataloader)"),
    "DataLoaderStateMixin": Refused("a base class of Accelerate's loaders",
                                    "torchrig.data_loader.DataLoaderShard (torchrig.data.PreparedDataLoader), which "
                                    "has end_of_dataloader and remainder"),
    "DataLoaderAdapter": Refused("a base class of Accelerate's loaders (torchdata's StatefulDataLoader adapter)",
                                 "torchrig.data_loader.DataLoaderShard: every prepared loader is resumable "
                                 "(state_dict/load_state_dict)"),
    "SkipDataLoader": Refused("a DataLoader subclass Accelerate builds for skip_first_batches",
                              "torchrig.skip_first_batches(dataloader, num_batches)"),
    "MpDeviceLoaderWrapper": XLA,
    # torch's own classes, which accelerate.data_loader imports: the same objects
    **{name: f"torch.utils.data:{name}" for name in ("BatchSampler", "DataLoader", "IterableDataset", "RandomSampler")},
    **_same_as(STATE, "GradientState", "PartialState"),
    **_same_as(LOGGING, "get_logger"),
    **_same_as(UTILS, "DistributedType", "RNGType", "broadcast", "broadcast_object_list", "compare_versions",
               "concatenate", "find_batch_size", "get_data_structure", "initialize_tensors", "is_datasets_available",
               "is_torch_version", "is_torch_xla_available", "is_torchdata_stateful_dataloader_available",
               "send_to_device", "slice_tensors", "synchronize_rng_states"),
}

OPTIMIZER: dict[str, Target] = {
    "AcceleratedOptimizer": "torchrig.optimizer:AcceleratedOptimizer",
    "move_to_device": "torchrig.optimizer:move_to_device",
    "patch_optimizer_step": Refused("an internal patch of Accelerate's optimizer wrapper to detect skipped steps",
                                    "accelerator.optimizer_step_was_skipped or AcceleratedOptimizer.step_was_skipped"),
    **_same_as(STATE, "AcceleratorState", "GradientState"),
    **_same_as(UTILS, "DistributedType", "honor_type", "is_lomo_available", "is_torch_xla_available"),
}

SCHEDULER: dict[str, Target] = {
    "AcceleratedScheduler": "torchrig.scheduler:OptimizerStepScheduler",
    **_same_as(STATE, "AcceleratorState", "GradientState"),
}

TRACKING: dict[str, Target] = {
    "GeneralTracker": "torchrig.tracking.hub:Tracker",
    "on_main_process": "torchrig.tracking.helpers:on_main_process",
    "get_available_trackers": "torchrig.tracking.helpers:get_available_trackers",
    **{name: _tracker(name) for name in (
        "TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker", "CometMLTracker", "AimTracker",
        "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker")},
    "register_tracker_class": Refused(
        "torchrig finds trackers through plugins (entry points), not a process-wide registry",
        "pass an instance — Accelerator(log_with=[MyTracker(...)]) — or package it as a tracker plugin "
        "(`torchrig new-plugin NAME tracker`, docs/plugins.md)"),
    "LOGGER_TYPE_TO_CLASS": Refused(
        "Accelerate's process-wide map from LoggerType to tracker class; torchrig finds trackers through plugins",
        "torchrig.tracking.get_available_trackers() for the usable log_with names, `torchrig plugins` for all"),
    "filter_trackers": Refused("an internal step of Accelerate's tracker selection",
                               "Accelerator(log_with=[...]): unknown or unavailable trackers fail there with the "
                               "plugin's name and install hint"),
    **_same_as(STATE, "PartialState"),
    **_same_as(LOGGING, "get_logger"),
    **_same_as(UTILS, "LoggerType", "compare_versions", "is_aim_available", "is_clearml_available",
               "is_comet_ml_available", "is_dvclive_available", "is_mlflow_available", "is_swanlab_available",
               "is_tensorboard_available", "is_trackio_available", "is_wandb_available", "listify", "str_to_bool"),
}

CHECKPOINTING: dict[str, Target] = {
    **{name: CHECKPOINT_INTERNAL for name in (
        "save_accelerator_state", "load_accelerator_state", "save_custom_state", "load_custom_state")},
    # torch's and safetensors' own objects, which accelerate.checkpointing imports: the same objects
    "GradScaler": "torch.amp:GradScaler",
    "load_model": "safetensors.torch:load_model",
    **_same_as(STATE, "PartialState"),
    **_same_as(LOGGING, "get_logger"),
    **_same_as(UTILS, "MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_NAME",
               "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME", "WEIGHTS_NAME", "get_pretty_name", "is_cuda_available",
               "is_hpu_available", "is_mlu_available", "is_musa_available", "is_neuron_available", "is_sdaa_available",
               "is_torch_version", "is_torch_xla_available", "is_xpu_available", "load", "save"),
}

#: ``accelerate.utils`` submodules mirrored as ``torchrig.utils.<name>`` (with the names
#: ``accelerate.utils`` re-exports from them); the others hold only refused or plugin-provided names,
#: reachable through ``torchrig.utils``.
MIRRORED_UTILS_SUBMODULES = ("constants", "dataclasses", "environment", "imports", "memory", "modeling",
                             "operations", "other", "random", "tqdm", "versions")

#: Accelerate module path -> name -> target.
TABLE: dict[str, dict[str, Target]] = {
    "accelerate": TOP_LEVEL,
    "accelerate.utils": UTILS,
    **{f"accelerate.utils.{name}": UTILS_SUBMODULES[f"accelerate.utils.{name}"] for name in MIRRORED_UTILS_SUBMODULES},
    "accelerate.state": STATE,
    "accelerate.logging": LOGGING,
    "accelerate.local_sgd": LOCAL_SGD,
    "accelerate.launchers": LAUNCHERS,
    "accelerate.big_modeling": BIG_MODELING,
    "accelerate.data_loader": DATA_LOADER,
    "accelerate.optimizer": OPTIMIZER,
    "accelerate.scheduler": SCHEDULER,
    "accelerate.tracking": TRACKING,
    "accelerate.checkpointing": CHECKPOINTING,
}

__all__ = ["ACCELERATE_SOURCE", "MIRRORED_UTILS_SUBMODULES", "TABLE"]
