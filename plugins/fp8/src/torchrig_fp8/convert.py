"""Which ``nn.Linear`` layers become torchao ``Float8Linear``, the conversion itself, and its report.

The default filter converts a Linear layer only when both its feature counts are multiples of 16
(``torch._scaled_mm`` needs them; ``pad_inner_dim`` pads instead), minus the first and last Linear
layers when ``skip_first_last`` is set and the layers matching ``exclude_modules`` globs. Every
decision is recorded in a :class:`ConversionReport` (attached to the converted module), so "K
layers run in fp8" is something a test or a user can check, not hope.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch

from torchrig_fp8.options import AORecipeKwargs

#: The attribute of a converted module holding its :class:`ConversionReport`.
REPORT_ATTRIBUTE = "_torchrig_fp8_report"
#: Messages torchao and torch log when torchao is imported on a machine without its CUDA kernels
#: (torch 2.13 CPU): harmless here, since emulation runs plain torch ops. Only these are dropped
#: (logger, text the message contains); a logger's filter sees only its own records.
_HARMLESS = (("torchao", "Failed to load "), ("torchao.kernel.intmm", "Detected no triton"),
             ("torch.utils._pytree", "is an Enum subclass and is now natively"))


class _DropHarmless(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def import_float8() -> Any:
    """``torchao.float8``, imported with the harmless missing-kernel messages filtered out (real
    errors still raise or log)."""
    filters = [(logging.getLogger(name), _DropHarmless(start)) for name, start in _HARMLESS]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        import torchao.float8 as float8
        import torchao.float8.float8_linear  # noqa: F401  (Float8Linear, read as float8.float8_linear)
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)
    return float8


@attrs.frozen
class ConversionReport:
    """What the fp8 conversion did to one model."""

    model: str
    recipe: str
    #: Fully qualified names of the Linear layers now running in fp8.
    converted: tuple[str, ...]
    #: Linear layers left in high precision -> why.
    skipped: dict[str, str]
    emulate: bool
    fsdp_float8_all_gather: bool

    @property
    def total(self) -> int:
        return len(self.converted) + len(self.skipped)

    def message(self) -> str:
        skipped = "; ".join(f"{name} ({why})" for name, why in self.skipped.items()) or "none"
        mode = ", emulated" if self.emulate else ""
        gather = ", FSDP2 fp8 all-gather" if self.fsdp_float8_all_gather else ""
        return (f"fp8: converted {len(self.converted)} of {self.total} Linear layers of {self.model} "
                f"(recipe {self.recipe}{mode}{gather}); skipped: {skipped}")


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def decide(model: torch.nn.Module, options: AORecipeKwargs,
           user_filter: Callable[[torch.nn.Module, str], bool] | None = None) -> tuple[list[str], dict[str, str]]:
    """Split the model's Linear layers into (converted, {skipped: reason})."""
    float8_linear = import_float8().float8_linear.Float8Linear
    layers = linear_layers(model)
    edges = {layers[0][0], layers[-1][0]} if options.skip_first_last and layers else set()
    # nn.MultiheadAttention reads out_proj.weight itself and never calls out_proj's forward.
    bypassed = {f"{name}.out_proj".lstrip(".") for name, module in model.named_modules()
                if isinstance(module, torch.nn.MultiheadAttention)}
    converted: list[str] = []
    skipped: dict[str, str] = {}
    for name, module in layers:
        pattern = next((glob for glob in options.exclude_modules if fnmatch.fnmatchcase(name, glob)), None)
        if isinstance(module, float8_linear):
            converted.append(name)  # converted before prepare (convert_model_to_fp8_ao)
        elif name in bypassed:
            skipped[name] = "nn.MultiheadAttention never calls its out_proj's forward"
        elif name in edges:
            skipped[name] = "first Linear layer" if name == layers[0][0] else "last Linear layer"
        elif pattern is not None:
            skipped[name] = f"matches exclude_modules {pattern!r}"
        elif user_filter is not None:
            if user_filter(module, name):
                converted.append(name)
            else:
                skipped[name] = "module_filter_func"
        elif not options.pad_inner_dim and (module.in_features % 16 or module.out_features % 16):
            skipped[name] = f"{module.in_features}x{module.out_features} features, not multiples of 16"
        else:
            converted.append(name)
    return converted, skipped


def float8_config(options: AORecipeKwargs, *, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for these options: the recipe's, or the one given in Python."""
    float8 = import_float8()
    if options.config is not None:
        config = options.config
        return dataclasses.replace(config, emulate=True) if emulate and not config.emulate else config
    config = float8.Float8LinearConfig.from_recipe_name(options.recipe)
    return dataclasses.replace(config, emulate=emulate, pad_inner_dim=options.pad_inner_dim,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def convert(model: torch.nn.Module, options: AORecipeKwargs, *, emulate: bool,
            fsdp_float8_all_gather: bool) -> ConversionReport:
    """Swap the chosen Linear layers for ``Float8Linear`` in place and attach the report."""
    float8 = import_float8()
    converted, skipped = decide(model, options, options.module_filter_func)
    config = float8_config(options, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather)
    chosen = set(converted)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, name: name in chosen)
    if _grad_weight_in_high_precision(config):
        modules = dict(model.named_modules())
        for name in converted:
            modules[name].register_forward_pre_hook(_inputs_in_autocast_dtype)
    report = ConversionReport(model=type(model).__name__, recipe=options.recipe if options.config is None else "config",
                              converted=tuple(converted), skipped=skipped, emulate=bool(config.emulate),
                              fsdp_float8_all_gather=bool(config.enable_fsdp_float8_all_gather))
    setattr(model, REPORT_ATTRIBUTE, report)
    return report


def _grad_weight_in_high_precision(config: Any) -> bool:
    """The recipe computes the weight gradient from the saved high-precision input (rowwise_with_gw_hp)."""
    cast = config.cast_config_input_for_grad_weight
    return cast is not None and cast.scaling_type.value == "disabled"


def _inputs_in_autocast_dtype(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Under autocast, hand a Float8Linear its input already in the autocast dtype (it casts it so
    itself): torchao 0.18 saves the input as given for the high-precision weight-gradient matmul,
    which then mixes an fp32 input with a bf16 gradient and fails."""
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def conversion_report(model: Any) -> ConversionReport | None:
    """The report of the fp8 conversion of ``model`` (the module ``prepare`` got, or
    ``accelerator.unwrap_model(prepared)``), None when it was not converted."""
    for candidate in (model, getattr(model, "_orig_mod", None), getattr(model, "module", None)):
        report = getattr(candidate, REPORT_ATTRIBUTE, None)
        if report is not None:
            return report
    return None


# -- Accelerate's names (accelerate.utils.ao) ----------------------------------------------------


def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a torchao ``Float8Linear`` layer."""
    float8_linear = import_float8().float8_linear.Float8Linear
    return any(isinstance(module, float8_linear) for module in model.modules())


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """Accelerate's ``module_filter_func``: convert a Linear layer whose features are multiples of 16.

    One module cannot tell whether it is its model's first or last layer (Accelerate's version
    looks for them inside the module itself, so it never skips them); torchrig skips them with
    ``fp8_config.skip_first_last: true``."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def convert_model_to_fp8_ao(model: torch.nn.Module, config: Any = None,
                            module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None) -> ConversionReport:
    """Accelerate's ``convert_model_to_fp8_ao``: convert in place, skipping the first and last Linear
    layers and those whose features are not multiples of 16 (Accelerate's default), or as
    ``module_filter_func`` says. Returns the report; ``emulate`` follows ``config``."""
    options = AORecipeKwargs(config=config, module_filter_func=module_filter_func,
                             skip_first_last=module_filter_func is None)
    given = config is not None
    return convert(model, options, emulate=bool(getattr(config, "emulate", False)),
                   fsdp_float8_all_gather=bool(getattr(config, "enable_fsdp_float8_all_gather", False)) if given else False)


__all__ = ["REPORT_ATTRIBUTE", "ConversionReport", "conversion_report", "convert", "convert_model_to_fp8_ao", "decide",
           "filter_first_and_last_linear_layers", "float8_config", "has_ao_layers", "import_float8", "linear_layers"]
