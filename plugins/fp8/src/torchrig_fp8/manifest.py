"""Manifest of the ``fp8`` precision: what torchrig knows about it without importing torch or torchao.

``requires = ("torchao",)`` is checked with ``find_spec``: without torchao the plugin is
*unavailable* and ``mixed_precision: fp8`` fails with ``pip install 'torchrig[fp8]'``. The
validation runs in the launcher and in every worker, so a machine that cannot run fp8 is refused
before any process starts (exit 2, naming the device and the emulation switch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

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


class FP8Manifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = ("fp8 training with torchao's Float8Linear (tensorwise, rowwise, rowwise_with_gw_hp), bf16 for the "
               "rest; FSDP2 fp8 all-gather")
    requires = ("torchao",)
    install_hint = "torchrig[fp8]"
    precision_type = "fp8"
    exports = {
        "AORecipeKwargs": "torchrig_fp8.options:AORecipeKwargs",
        "FP8RecipeKwargs": "torchrig_fp8.options:FP8RecipeKwargs",
        "convert_model_to_fp8_ao": "torchrig_fp8.convert:convert_model_to_fp8_ao",
        "filter_first_and_last_linear_layers": "torchrig_fp8.convert:filter_first_and_last_linear_layers",
        "has_ao_layers": "torchrig_fp8.convert:has_ao_layers",
    }
    config_section = ConfigSection(SECTION, "torchrig_fp8.options:AORecipeKwargs", aliases=("fp8_kwargs",),
                                   help="AORecipeKwargs / FP8RecipeKwargs: torchao fp8 recipe, layer filter, "
                                        "FSDP2 fp8 all-gather, emulation")
    cli_flags = (
        CliFlag("--fp8_recipe", f"{SECTION}.recipe", "torchao fp8 recipe", choices=RECIPES),
        CliFlag("--fp8_emulate", f"{SECTION}.emulate", "emulate fp8 matmuls where the device cannot run them "
                "(CPU, GPUs below capability 8.9): for tests", type="bool"),
        CliFlag("--fp8_skip_first_last", f"{SECTION}.skip_first_last",
                "leave the first and last Linear layers in high precision", type="bool"),
        CliFlag("--fp8_exclude_modules", f"{SECTION}.exclude_modules",
                "comma-separated module-name globs to leave in high precision", type="list"),
        CliFlag("--fp8_enable_fsdp_float8_all_gather", f"{SECTION}.enable_fsdp_float8_all_gather",
                "FSDP2 all-gathers fp8 weights (tensorwise recipe)", type="bool"),
    )

    @hookimpl
    def torchrig_validate_config(self, config: Mapping[str, Any]) -> list[ConfigProblem]:
        return fp8_problems(config)


def fp8_problems(config: Mapping[str, Any]) -> list[ConfigProblem]:
    """Keys that cannot take effect, and machines that cannot run fp8 without the emulation switch."""
    problems: list[ConfigProblem] = []
    backend = config.get(f"{SECTION}.backend", "AO")
    if backend != "AO":
        problems.append(ConfigProblem(f"{SECTION}.backend", (
            f"{backend!r} is not supported: torchrig's fp8 runs on torchao (backend: AO); NVIDIA TransformerEngine "
            "and MS-AMP are not available")))
    for key, other in OTHER_BACKEND_KEYS.items():
        if config.get(f"{SECTION}.{key}") is not None:
            problems.append(ConfigProblem(f"{SECTION}.{key}", (
                f"is a {'TransformerEngine' if other == 'TE' else 'MS-AMP'} option and cannot take effect: torchrig's "
                "fp8 runs on torchao (backend: AO); remove it")))
    recipe = config.get(f"{SECTION}.recipe", "tensorwise")
    if config.get(f"{SECTION}.enable_fsdp_float8_all_gather") and recipe != "tensorwise":
        problems.append(ConfigProblem(f"{SECTION}.enable_fsdp_float8_all_gather", (
            f"needs the tensorwise recipe (torchao all-gathers fp8 weights with one scale per tensor), but recipe "
            f"is {recipe!r}; set recipe: tensorwise or enable_fsdp_float8_all_gather: false")))
    if config.get(f"{SECTION}.config") is not None:
        for key, default in (("recipe", "tensorwise"), ("pad_inner_dim", False),
                             ("enable_fsdp_float8_all_gather", None)):
            if config.get(f"{SECTION}.{key}", default) != default:
                problems.append(ConfigProblem(f"{SECTION}.{key}", (
                    "cannot take effect together with fp8_config.config (a Float8LinearConfig is used as given); "
                    "set it on the Float8LinearConfig instead")))
    problem = hardware_problem(config)
    if problem:
        problems.append(ConfigProblem("mixed_precision", problem))
    return problems


def emulation_on(config: Mapping[str, Any]) -> bool:
    """The emulation switch, or a ``Float8LinearConfig(emulate=True)`` given in Python."""
    given = config.get(f"{SECTION}.config")
    return bool(config.get(f"{SECTION}.emulate")) or bool(getattr(given, "emulate", False))


def hardware_problem(config: Mapping[str, Any], device: str | None = None) -> str | None:
    """Why this run cannot use fp8 for speed, or None — also None with the emulation switch on."""
    return None if emulation_on(config) else device_problem(config, device)


def device_problem(config: Mapping[str, Any], device: str | None = None) -> str | None:
    """Why the device cannot run fp8 matmuls, or None.

    ``device``: the run's device (``"cpu"``, ``"cuda:0"``) once known; before that, the configured
    ``use_cpu``/``device`` and what torch sees (imported only here, only when asked)."""
    switch = (f"set fp8_config.emulate: true ({EMULATE_ENV}=1, --fp8_emulate) to run it emulated for testing, or "
              "use mixed_precision: bf16")
    if device is None and (config.get("use_cpu") or config.get("device") == "cpu"):
        device = "cpu"
    if device is None or device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            device = "cpu"
        else:
            index = torch.device(device or "cuda").index or 0
            capability = torch.cuda.get_device_capability(index)
            if capability < MIN_CAPABILITY:
                return (f"fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
                        f"(Ada, Hopper, Blackwell); {torch.cuda.get_device_name(index)} (cuda:{index}) has "
                        f"{capability[0]}.{capability[1]}, where fp8 is emulated and slower than bf16; {switch}")
            return None
    return (f"fp8 matmuls need a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; "
            f"this run's device is {device}, where fp8 is only emulated (slower than bf16); {switch}")


__all__ = ["MIN_CAPABILITY", "FP8Manifest", "device_problem", "emulation_on", "fp8_problems", "hardware_problem"]
