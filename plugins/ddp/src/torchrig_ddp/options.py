"""``DistributedDataParallelKwargs``: Accelerate's class and parameters, as torchrig's ``ddp_config``.

The same object is what a script passes (``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)])``)
and what a config file's ``ddp_config:`` section, ``TORCHRIG_DDP_CONFIG__*`` variables and the
``--ddp_*`` flags set. Torch-free: manifests and the CLI import it; the runtime turns it into
``DistributedDataParallel(...)`` keyword arguments and a registered communication hook.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
from torchrig.plugin import KwargsHandler, at_least, enum_name, option

from torchrig_ddp.constants import COMM_HOOKS, COMM_WRAPPERS, POWER_SGD_HOOKS


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for the ``comm_hook``/``comm_wrapper`` values (``str()`` is the value)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return str(self.value)


def _hook_name(value: Any) -> Any:
    """Accelerate's ``DDPCommunicationHookType`` member or any spelling -> lower-case value.

    Never raises: a value that is not a name is left for type coercion to report."""
    if value is None:
        return "no"
    value = enum_name(value)
    return value.strip().lower() if isinstance(value, str) else value


def _one_of(allowed: tuple[str, ...]) -> Any:
    """Validator for direct construction (``DistributedDataParallelKwargs(comm_hook="x")``); values from
    files are already checked against ``choices`` with a did-you-mean by the resolver."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {value!r}", attribute)

    return check


@attrs.frozen(kw_only=True)
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``torch.nn.parallel.DistributedDataParallel`` and its communication hook.

    Defaults are DDP's own (and Accelerate's), so an empty section changes nothing.
    """

    dim: int = option(0, help="dimension along which DDP scatters inputs (DistributedDataParallel dim)",
                      validator=at_least(0))
    broadcast_buffers: bool = option(True, help="broadcast module buffers from rank 0 at every forward")
    bucket_cap_mb: int = option(25, help="gradient bucket size in MiB for all-reduce", validator=at_least(1))
    find_unused_parameters: bool = option(False, help="traverse the autograd graph for parameters that got no "
                                                      "gradient (needed when some parameters are unused; slower)")
    check_reduction: bool = option(False, help="deprecated in torch and ignored by it; accepted for compatibility")
    gradient_as_bucket_view: bool = option(False, help="gradients are views into the all-reduce buckets "
                                                       "(saves one gradient-sized copy of memory)")
    static_graph: bool = option(False, help="the set of used parameters and the graph do not change between "
                                            "iterations (enables DDP's static-graph optimisations)")
    comm_hook: str = option("no", help="gradient communication hook: no, fp16, bf16 (compress gradients before "
                                       "all-reduce), power_sgd, batched_power_sgd",
                            choices=COMM_HOOKS, normalize=_hook_name, converter=_hook_name,
                            validator=_one_of(COMM_HOOKS))
    comm_wrapper: str = option("no", help="wrap the PowerSGD hook with fp16 or bf16 compression: no, fp16, bf16",
                               choices=COMM_WRAPPERS, normalize=_hook_name, converter=_hook_name,
                               validator=_one_of(COMM_WRAPPERS))
    comm_state_option: dict[str, Any] | None = option(
        None, help="PowerSGDState arguments for the power_sgd hooks (matrix_approximation_rank, "
                   "start_powerSGD_iter, ...)")


__all__ = ["COMM_HOOKS", "COMM_WRAPPERS", "POWER_SGD_HOOKS", "DDPCommunicationHookType", "DistributedDataParallelKwargs"]
