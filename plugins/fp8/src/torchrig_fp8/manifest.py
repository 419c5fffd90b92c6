"""Manifest of the ``fp8`` precision: what torchrig knows about it without importing torch or torchao.

``requires = ("torchao",)`` is checked with ``find_spec``: without torchao the plugin is
*unavailable* and ``mixed_precision: fp8`` fails with ``pip install 'torchrig[fp8]'``. The
validation (:mod:`torchrig_fp8.config_checks`) runs in the launcher and in every worker, so a
machine that cannot run fp8 is refused before any process starts (exit 2, naming the device and
the emulation switch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_fp8.constants import RECIPES, SECTION

if TYPE_CHECKING:
    from torchrig.plugin import ResolvedConfig


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
    def torchrig_validate_config(self, config: ResolvedConfig) -> list[ConfigProblem]:
        """See :mod:`torchrig_fp8.config_checks` (imported here: it reads the typed section, so it
        imports the options class, which a run without fp8 never loads — benchmark B12)."""
        from torchrig_fp8.config_checks import fp8_problems

        return fp8_problems(config)


__all__ = ["FP8Manifest"]
