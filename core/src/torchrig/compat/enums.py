"""Accelerate's string enums, with the same member names, values and ``str()`` behaviour.

Scripts compare what torchrig reports against these (``accelerator.distributed_type ==
DistributedType.MULTI_GPU``, ``log_with=LoggerType.TENSORBOARD``), so each member equals its
Accelerate counterpart: the ``str`` mixins compare by value, even with Accelerate's own enum.

``DistributedType`` and ``PrecisionType`` are not closed: torchrig never derives them from a
plugin's name — each selected plugin *declares* the member it answers to in its manifest
(``PluginManifest.distributed_type``, ``PluginManifest.precision_type``), and a value no member
has (a third-party strategy that answers to none) becomes a pseudo-member that equals only
itself and its own string. Torch-free.
"""

from __future__ import annotations

import enum
from typing import Any


class _ContainsValues(enum.EnumMeta):
    """``"fp16" in PrecisionType``: membership by value, as Accelerate's enums allow."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ValueEnum(enum.Enum, metaclass=_ContainsValues):
    """``str(member)`` is its value (Accelerate's ``BaseEnum``)."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class _OpenStrEnum(str, enum.Enum):
    """A str enum that accepts values outside its members as pseudo-members (never added to
    the member list), so a plugin can answer with a value Accelerate does not have."""

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return None
        pseudo = str.__new__(cls, value)
        pseudo._name_ = value
        pseudo._value_ = value
        return pseudo


class DistributedType(_OpenStrEnum):
    """The distributed environment a run uses, as Accelerate names it. Which member a run answers
    to comes from the selected strategy's manifest (and, for data parallelism, the device's)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(_OpenStrEnum):
    """The mixed-precision mode, as Accelerate names it (``str()`` is the value, as there)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class ComputeEnvironment(str, enum.Enum):
    """Where the run is launched from (config key ``compute_environment``)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DynamoBackend(str, _ValueEnum):
    """``torch.compile`` backends by Accelerate's names (``dynamo_backend=`` accepts them)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(_ValueEnum):
    """Tracker names (``log_with=LoggerType.TENSORBOARD``); a name no installed tracker plugin
    provides fails at ``Accelerator(...)`` with the plugin-not-found error and its install hint."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class RNGType(_ValueEnum):
    """Random number generators Accelerate synchronises (``Accelerator(rng_types=...)``,
    ``synchronize_rng_states``)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"

    @classmethod
    def parse_all(cls, values: Any, where: str) -> list[RNGType] | None:
        """``values`` as members (``None`` stays ``None``); a ValueError naming ``where`` and the
        bad value otherwise. torchrig's prepared loaders shuffle from their own seeded generator,
        identical on every process, so no global generator needs synchronising; the members are
        validated and kept for scripts that read them back."""
        if values is None:
            return None
        if isinstance(values, (str, RNGType)):
            values = [values]
        parsed = []
        for value in values:
            try:
                parsed.append(cls(str(value)))
            except ValueError:
                raise ValueError(f"{where}: {value!r} is not a random number generator Accelerate knows; use "
                                 f"{', '.join(member.value for member in cls)} (torchrig's prepared loaders shuffle "
                                 "from their own seeded generator, so none needs synchronising)") from None
        return parsed


class CustomDtype(enum.Enum):
    """Sub-byte and fp8 storage types, for size computations (``dtype_byte_size``)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


__all__ = ["ComputeEnvironment", "CustomDtype", "DistributedType", "DynamoBackend", "LoggerType", "PrecisionType",
           "RNGType"]
