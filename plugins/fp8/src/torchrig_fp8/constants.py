"""The ``fp8`` plugin's names, shared by its manifest (flag choices), its options class and its
checks; torch-free and import-free, so the manifest never imports the options class."""

from __future__ import annotations

SECTION = "fp8_config"
#: torchao's ``Float8LinearConfig.from_recipe_name`` recipes.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: Accelerate's fp8 backends; only ``AO`` (torchao) is served.
BACKENDS = ("AO", "TE", "MSAMP")
#: Accelerate's keys of the TransformerEngine and MS-AMP backends (field name -> backend).
OTHER_BACKEND_KEYS = {
    "use_autocast_during_eval": "TE", "margin": "TE", "interval": "TE", "fp8_format": "TE",
    "amax_history_len": "TE", "amax_compute_algo": "TE", "override_linear_precision": "TE", "opt_level": "MSAMP",
}
#: The environment variable of the emulation switch (the section's generic spelling).
EMULATE_ENV = "TORCHRIG_FP8_CONFIG__EMULATE"
#: fp8 matmuls (``torch._scaled_mm``) need CUDA compute capability 8.9 (Ada, Hopper) or newer.
MIN_CAPABILITY = (8, 9)

__all__ = ["BACKENDS", "EMULATE_ENV", "MIN_CAPABILITY", "OTHER_BACKEND_KEYS", "RECIPES", "SECTION"]
