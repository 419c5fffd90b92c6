"""``fp8_config``: the fp8 precision plugin's options, under Accelerate's names.

One class is what a script passes (``Accelerator(mixed_precision="fp8",
kwargs_handlers=[AORecipeKwargs(...)])``; Accelerate's deprecated ``FP8RecipeKwargs`` is the same
class) and what a config file's ``fp8_config:`` section, ``TORCHRIG_FP8_CONFIG__*`` variables and
the ``--fp8_*`` flags set. Torch-free: the manifest and the CLI import it.

Accelerate's TransformerEngine and MS-AMP keys are declared too, so that a file written for those
backends is refused naming each key (torchrig's fp8 runs on torchao only), never silently ignored.
"""

from __future__ import annotations

from typing import Any

import attrs
from torchrig.plugin import KwargsHandler, option

from torchrig_fp8.constants import BACKENDS, EMULATE_ENV, OTHER_BACKEND_KEYS, RECIPES, SECTION


def _upper(value: Any) -> Any:
    return value.strip().upper() if isinstance(value, str) else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _names(value: Any) -> Any:
    """``"a.*, b"`` (a flag or variable) -> ``["a.*", "b"]``; lists pass through."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _other_backend(help_text: str, aliases: tuple[str, ...] = ()) -> Any:
    return option(None, help=f"{help_text} (refused: torchrig's fp8 runs on torchao, backend AO)", aliases=aliases)


@attrs.frozen(kw_only=True)
class AORecipeKwargs(KwargsHandler):
    """fp8 training with torchao's ``Float8Linear``: which recipe, which layers, and the switches
    that compose it with FSDP2 and with machines that cannot run fp8 matmuls."""

    backend: str = option("AO", help="fp8 backend: AO (torchao). Accelerate's TE and MSAMP are refused",
                          normalize=_upper, converter=_upper)
    recipe: str = option("tensorwise", help="torchao recipe: tensorwise (one scale per tensor; FSDP2 fp8 all-gather), "
                                            "rowwise (one scale per row), rowwise_with_gw_hp (rowwise, the weight "
                                            "gradient in high precision)",
                         choices=RECIPES, normalize=_lower, converter=_lower)
    config: Any = option(None, python_only=True,
                         help="a torchao Float8LinearConfig used as given instead of recipe, pad_inner_dim and "
                              "enable_fsdp_float8_all_gather (Python only)")
    module_filter_func: Any = option(None, python_only=True,
                                     help="(module, fully qualified name) -> bool: which Linear layers to convert, "
                                          "instead of the default filter (Python only)")
    pad_inner_dim: bool = option(False, help="pad Linear dimensions to multiples of 16 so that layers whose "
                                             "features are not multiples of 16 are converted too (otherwise they "
                                             "are skipped)")
    enable_fsdp_float8_all_gather: bool | None = option(
        None, help="FSDP2 all-gathers converted weights in fp8 (half bf16's bytes) with the scales precomputed after "
                   "each optimizer step; default: on when the strategy shards with fully_shard and the recipe is "
                   "tensorwise")
    skip_first_last: bool = option(False, help="leave the first and the last Linear layer in high precision "
                                               "(Accelerate's filter_first_and_last_linear_layers)")
    exclude_modules: list[str] = option(factory=list, help="module-name globs (fnmatch) of Linear layers to leave "
                                                           "in high precision, e.g. ['lm_head', '*.gate']",
                                        converter=_names)
    emulate: bool = option(False, help="run fp8 matmuls emulated in high precision where the device cannot run them "
                                       "(CPU, GPUs below compute capability 8.9): for tests, never for speed")
    # Accelerate's keys of other backends: declared so that they are refused by name.
    use_autocast_during_eval: Any = _other_backend("TransformerEngine: autocast during evaluation")
    margin: Any = _other_backend("TransformerEngine: scaling-factor margin")
    interval: Any = _other_backend("TransformerEngine: scaling-factor update interval")
    fp8_format: Any = _other_backend("TransformerEngine: E4M3 or HYBRID")
    amax_history_len: Any = _other_backend("TransformerEngine: amax history length", ("amax_history_length",))
    amax_compute_algo: Any = _other_backend("TransformerEngine: amax algorithm", ("amax_compute_algorithm",))
    override_linear_precision: Any = _other_backend("TransformerEngine: per-GEMM high precision")
    opt_level: Any = _other_backend("MS-AMP: optimization level", ("optimization_level",))


#: Accelerate's deprecated name for the same options (``FP8RecipeKwargs(backend="AO")``).
FP8RecipeKwargs = AORecipeKwargs

__all__ = ["BACKENDS", "EMULATE_ENV", "OTHER_BACKEND_KEYS", "RECIPES", "SECTION", "AORecipeKwargs", "FP8RecipeKwargs"]
