"""Accelerate's file-name constants, with the values torchrig's checkpoints really use.

``tests/compat/test_accelerate_names.py`` saves a checkpoint and finds these names in it, so code that
builds paths from them (``os.path.join(ckpt, SAFE_WEIGHTS_NAME)``) reads torchrig's files.
Torch-free.
"""

from __future__ import annotations

from torchrig.compat.resolve import module_attributes

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
#: torchrig saves a prepared loader's position as ``dl_state_dict*.bin``; Accelerate's sampler file
#: name is kept for scripts that test for it.
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
#: ``accelerator.profile()`` writes ``profile_<process index>.json`` into ``output_trace_dir``.
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

#: ``torchrun`` parameters (what ``torchrig launch`` passes on to torch elastic).
TORCH_LAUNCH_PARAMS = [
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
    "max_restarts", "monitor_interval", "start_method", "role", "module", "m", "no_python", "run_path", "log_dir",
    "r", "redirects", "t", "tee", "node_rank", "master_addr", "master_port",
]
#: ``DistributedType`` values whose collectives go through ``torch.distributed``.
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    "DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
    "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON",
]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
