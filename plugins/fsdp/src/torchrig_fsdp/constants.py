"""The ``fsdp`` plugin's names, shared by its manifest (flag choices), its options class and the
runtime; torch-free and import-free, so the manifest never imports the options class."""

from __future__ import annotations

SECTION = "fsdp_config"
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
#: Sharding strategies that replicate across machines and shard within one (a 2-D mesh).
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

__all__ = ["AUTO_WRAP_POLICIES", "BACKWARD_PREFETCH", "HYBRID", "SECTION", "SHARDING_STRATEGIES", "STATE_DICT_TYPES"]
