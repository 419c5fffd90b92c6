"""fp8's configuration checks (``torchrig_validate_config``) and the device question the
precision plugin asks again once the run's device is known.

Reads the typed section (:class:`~torchrig_fp8.options.AORecipeKwargs`, whose defaults are the
only ones) and the core's (:class:`CoreOptions`). Torch-free at import: torch is imported only
to ask about the device.
"""

from __future__ import annotations

import attrs
from torchrig.plugin import ConfigProblem, CoreOptions, ResolvedConfig

from torchrig_fp8.constants import EMULATE_ENV, MIN_CAPABILITY, OTHER_BACKEND_KEYS, SECTION
from torchrig_fp8.options import AORecipeKwargs

#: Fields a ``Float8LinearConfig`` given as ``config`` replaces: set to anything but their default
#: beside it, they cannot take effect.
REPLACED_BY_CONFIG = ("recipe", "pad_inner_dim", "enable_fsdp_float8_all_gather")


def fp8_problems(config: ResolvedConfig) -> list[ConfigProblem]:
    """Keys that cannot take effect, and machines that cannot run fp8 without the emulation switch."""
    problems: list[ConfigProblem] = []
    options = config.section_of(AORecipeKwargs)
    if options.backend != "AO":
        problems.append(ConfigProblem(f"{SECTION}.backend", (
            f"{options.backend!r} is not supported: torchrig's fp8 runs on torchao (backend: AO); NVIDIA "
            "TransformerEngine and MS-AMP are not available")))
    for key, other in OTHER_BACKEND_KEYS.items():
        if getattr(options, key) is not None:
            problems.append(ConfigProblem(f"{SECTION}.{key}", (
                f"is a {'TransformerEngine' if other == 'TE' else 'MS-AMP'} option and cannot take effect: torchrig's "
                "fp8 runs on torchao (backend: AO); remove it")))
    if options.enable_fsdp_float8_all_gather and options.recipe != "tensorwise":
        problems.append(ConfigProblem(f"{SECTION}.enable_fsdp_float8_all_gather", (
            f"needs the tensorwise recipe (torchao all-gathers fp8 weights with one scale per tensor), but recipe "
            f"is {options.recipe!r}; set recipe: tensorwise or enable_fsdp_float8_all_gather: false")))
    if options.config is not None:
        defaults = attrs.fields_dict(AORecipeKwargs)
        for key in REPLACED_BY_CONFIG:
            if getattr(options, key) != defaults[key].default:
                problems.append(ConfigProblem(f"{SECTION}.{key}", (
                    "cannot take effect together with fp8_config.config (a Float8LinearConfig is used as given); "
                    "set it on the Float8LinearConfig instead")))
    problem = hardware_problem(config)
    if problem:
        problems.append(ConfigProblem("mixed_precision", problem))
    return problems


def emulation_on(config: ResolvedConfig) -> bool:
    """The emulation switch, or a ``Float8LinearConfig(emulate=True)`` given in Python."""
    options = config.section_of(AORecipeKwargs)
    return bool(options.emulate) or bool(getattr(options.config, "emulate", False))


def hardware_problem(config: ResolvedConfig, device: str | None = None) -> str | None:
    """Why this run cannot use fp8 for speed, or None — also None with the emulation switch on."""
    return None if emulation_on(config) else device_problem(config, device)


def device_problem(config: ResolvedConfig, device: str | None = None) -> str | None:
    """Why the device cannot run fp8 matmuls, or None.

    ``device``: the run's device (``"cpu"``, ``"cuda:0"``) once known; before that, the configured
    ``use_cpu``/``device`` and what torch sees (imported only here, only when asked)."""
    switch = (f"set fp8_config.emulate: true ({EMULATE_ENV}=1, --fp8_emulate) to run it emulated for testing, or "
              "use mixed_precision: bf16")
    core = config.section_of(CoreOptions)
    if device is None and (core.use_cpu or core.device == "cpu"):
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


__all__ = ["REPLACED_BY_CONFIG", "device_problem", "emulation_on", "fp8_problems", "hardware_problem"]
