"""Manifests of the built-in plugins. Torch-free: loaded for ``torchrig --help`` and listing."""

from __future__ import annotations

from torchrig.hookspecs import HOOK_API_VERSION
from torchrig.manifest import PluginManifest


class SINGLE(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "one process on one device, no distribution"
    install_hint = "torchrig"
    aliases = ("NO",)


class _Precision(PluginManifest):
    api_version = HOOK_API_VERSION
    install_hint = "torchrig"


class PRECISION_NO(_Precision):
    summary = "full fp32 precision"


class PRECISION_FP16(_Precision):
    summary = "float16 autocast with a dynamic GradScaler"


class PRECISION_BF16(_Precision):
    summary = "bfloat16 autocast"


class _Device(PluginManifest):
    api_version = HOOK_API_VERSION
    install_hint = "torchrig"


class DEVICE_CPU(_Device):
    summary = "the CPU (gloo process groups); the fallback when no accelerator is available"
    priority = 0


class DEVICE_MPS(_Device):
    summary = "Apple Metal (MPS)"
    priority = 50


class DEVICE_CUDA(_Device):
    summary = "NVIDIA CUDA GPUs (nccl process groups), one per local rank"
    priority = 100


class CLUSTER_TORCHELASTIC(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "workers started by torch elastic (torchrun, torchrig launch): RANK, WORLD_SIZE, MASTER_ADDR..."
    install_hint = "torchrig"
    priority = 50
