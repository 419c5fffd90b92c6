"""``is_<library>_available`` checks with Accelerate's names and semantics.

A library counts as available when its module can be found *and* its distribution metadata exists
(a stray directory with the module's name does not count); nothing is imported to find out.
Device checks ask torch. These report what is installed, not what torchrig supports: an installed
``torch_xla`` makes ``is_torch_xla_available()`` true although no XLA device plugin exists.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from torchrig.compat.enums import DistributedType
from torchrig.compat.resolve import module_attributes
from torchrig.host.runtime import declared_distributed_type, latest_run
from torchrig.utils.environment import patch_environment
from torchrig.utils.versions import compare_versions, is_torch_version


def _installed(module: str, *distributions: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    for distribution in distributions or (module,):
        try:
            importlib.metadata.metadata(distribution)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _at_least(module: str, version: str, distribution: str | None = None) -> bool:
    return _installed(module, distribution or module) and compare_versions(distribution or module, ">=", version)


def _import_check(module: str) -> bool:
    """Find the module, then import it (device extensions register themselves with torch on import)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _torch_device(name: str) -> bool:
    import torch

    backend = getattr(torch, name, None)
    return backend is not None and bool(backend.is_available())


def is_aim_available() -> bool:
    return _installed("aim") and compare_versions("aim", "<", "4.0.0")


def is_amdsmi_available() -> bool:
    return _installed("amdsmi")


def is_boto3_available() -> bool:
    return _installed("boto3")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml", "comet_ml", "comet-ml")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_import_timer_available() -> bool:
    return _installed("import_timer", "import_timer", "import-timer")


def is_lomo_available() -> bool:
    return _installed("lomo_optim", "lomo_optim", "lomo-optim")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_megatron_lm_available() -> bool:
    return _installed("megatron", "megatron-core")


def is_mlflow_available() -> bool:
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_msamp_available() -> bool:
    return _installed("msamp", "ms-amp")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_peft_available() -> bool:
    return _installed("peft")


def is_pynvml_available() -> bool:
    return _installed("pynvml", "pynvml", "nvidia-ml-py")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_rich_available() -> bool:
    return _installed("rich")


def is_sagemaker_available() -> bool:
    return _installed("sagemaker")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _at_least("torchdata", "0.8.0")


def is_torchao_available() -> bool:
    return _at_least("torchao", "0.6.1")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_trackio_available() -> bool:
    return _installed("trackio")


def is_transformer_engine_available() -> bool:
    return _installed("transformer_engine", "transformer-engine", "transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    if not is_transformer_engine_available():
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_triton_available() -> bool:
    return _installed("triton", "triton", "pytorch-triton", "triton-xpu")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_bnb_available(min_version: str | None = None) -> bool:
    if min_version is not None:
        return _at_least("bitsandbytes", min_version)
    return _installed("bitsandbytes")


def is_4bit_bnb_available() -> bool:
    return _at_least("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    return _at_least("bitsandbytes", "0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


# -- devices and numerics ------------------------------------------------------------------------


def is_cuda_available() -> bool:
    """Whether CUDA is usable, asked through NVML so that the CUDA driver is not initialised
    (a process that forks workers afterwards must not have initialised it)."""
    import torch

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return bool(torch.cuda.is_available())


def is_mps_available(min_version: str = "1.12") -> bool:
    import torch

    return is_torch_version(">=", min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_rocm_available() -> bool:
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    if is_torch_version("<=", "2.6"):
        return False
    return _torch_device("xpu")


def is_npu_available(check_device: bool = False) -> bool:
    return _import_check("torch_npu") and _torch_device("npu")


def is_mlu_available(check_device: bool = False) -> bool:
    return _import_check("torch_mlu") and _torch_device("mlu")


def is_musa_available(check_device: bool = False) -> bool:
    return _import_check("torch_musa") and _torch_device("musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    return _import_check("torch_sdaa") and _torch_device("sdaa")


def is_neuron_available(check_device: bool = False) -> bool:
    return _import_check("torch_neuronx") and _torch_device("neuron")


def is_hpu_available(init_hccl: bool = False) -> bool:
    return (importlib.util.find_spec("habana_frameworks") is not None and _import_check("habana_frameworks.torch")
            and _torch_device("hpu"))


def is_habana_gaudi1() -> bool:
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return bool(htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi)


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True")
    if not _installed("torch_xla"):
        return False
    if check_is_tpu or check_is_gpu:
        import torch_xla.runtime

        kind = torch_xla.runtime.device_type()
        return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")
    return True


def is_xccl_available() -> bool:
    import torch.distributed as dist

    return is_torch_version(">=", "2.7.0") and bool(getattr(dist.distributed_c10d, "is_xccl_available", lambda: False)())


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    import torch

    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    return not is_habana_gaudi1()


def is_fp8_available() -> bool:
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_pippy_available() -> bool:
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    return is_torch_version(">=", "2.4.0")


def get_current_device_type() -> tuple[str, str]:
    """``(device type, DistributedType value)`` of the accelerator this process would use, without
    initialising it: ``("cuda", "MULTI_GPU")``, ..., else ``("cpu", "MULTI_CPU")`` (Accelerate
    answers ``cuda`` even without a GPU; torchrig says what is there)."""
    for device, check, distributed in (("mlu", is_mlu_available, "MULTI_MLU"), ("sdaa", is_sdaa_available, "MULTI_SDAA"),
                                       ("musa", is_musa_available, "MULTI_MUSA"), ("npu", is_npu_available, "MULTI_NPU"),
                                       ("hpu", is_hpu_available, "MULTI_HPU"), ("cuda", is_cuda_available, "MULTI_GPU"),
                                       ("xpu", is_xpu_available, "MULTI_XPU"),
                                       ("neuron", is_neuron_available, "MULTI_NEURON")):
        if check():
            return device, distributed
    return "cpu", "MULTI_CPU"


# -- decorators ------------------------------------------------------------------------------------


def torchao_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Calling ``func`` without torchao installed raises an ``ImportError`` saying how to install it."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(f"{func.__name__} needs torchao >= 0.6.1: pip install torchao")
        return func(*args, **kwargs)

    return wrapper


def deepspeed_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Calling ``func`` while this process runs a strategy that is not DeepSpeed raises ``ValueError``."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = latest_run()
        if run is not None and declared_distributed_type(run) != DistributedType.DEEPSPEED:
            raise ValueError(f"{func.__name__} needs the deepspeed strategy; this process runs "
                             f"{run.config.get('strategy')!r} (configure strategy: deepspeed)")
        return func(*args, **kwargs)

    return wrapper


__all__ = sorted(name for name in dir(sys.modules[__name__])
                 if name.startswith(("is_", "deepspeed_", "torchao_")) or name == "get_current_device_type")

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
