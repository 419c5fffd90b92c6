"""The ``ddp`` plugin's names, shared by its manifest (flag choices) and its options class
(validators); torch-free and import-free, so neither has to import the other."""

from __future__ import annotations

SECTION = "ddp_config"
#: ``comm_hook`` values: which ``torch.distributed.algorithms.ddp_comm_hooks`` hook to register.
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
#: ``comm_wrapper`` values: a compression wrapper around a PowerSGD hook.
COMM_WRAPPERS = ("no", "fp16", "bf16")
#: Hooks that take a ``PowerSGDState`` (``comm_state_option``) and may be wrapped.
POWER_SGD_HOOKS = ("power_sgd", "batched_power_sgd")

__all__ = ["COMM_HOOKS", "COMM_WRAPPERS", "POWER_SGD_HOOKS", "SECTION"]
