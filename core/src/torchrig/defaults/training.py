"""The core's training defaults: prepare the model, dataloader and scheduler, save and load the
plain strategy state. Registered as ``"core:training-defaults"`` by the Accelerator (the only
caller of these hooks; also :func:`torchrig.testing.make_host` and the launcher's dry run), so
they may use data and checkpoint, which sit above the runtime.

Torch-free to import (see :mod:`torchrig.defaults.process`): the data and state-dict modules,
which import torch, are imported inside the implementations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchrig.checkpoint.files import CheckpointWriter
from torchrig.defaults import process
from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import PreparedModel
from torchrig.scheduler import OptimizerStepScheduler
from torchrig.training.gradient_state import gradient_state_of

#: The pluggy name of this family.
NAME = "core:training-defaults"


class TrainingDefaults:
    """What the core does with the user's objects when no strategy or precision plugin answers."""

    @hookimpl(trylast=True)
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        assert run.device is not None
        if device_placement and not run.planning:  # a planned run's model stays on the meta device
            model.to(run.device.device)
        return PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))

    @hookimpl(trylast=True)
    def torchrig_prepare_dataloader(self, run: RunContext, dataloader: Any, device_placement: bool) -> Any:
        from torchrig.data import prepare_dataloader  # torch: see the module docstring

        return prepare_dataloader(run, dataloader, device_placement=device_placement)

    @hookimpl(trylast=True)
    def torchrig_prepare_scheduler(self, run: RunContext, scheduler: Any, optimizers: Sequence[Any]) -> Any:
        return OptimizerStepScheduler(scheduler, optimizers, gradient_state_of(run))

    @hookimpl(trylast=True)
    def torchrig_save_strategy_state(
        self, run: RunContext, prepared: Sequence[PreparedModel], writer: CheckpointWriter
    ) -> list[str]:
        from torchrig.checkpoint.state_dicts import save_plain_state  # torch: see the module docstring

        return save_plain_state(run, prepared, writer)

    @hookimpl(trylast=True)
    def torchrig_load_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     manifest: Mapping[str, Any]) -> bool:
        from torchrig.checkpoint.state_dicts import load_plain_state  # torch: see the module docstring

        load_plain_state(run, prepared, directory, manifest)
        return True

    @hookimpl(trylast=True)
    def torchrig_full_state_dict(self, run: RunContext, prepared: PreparedModel) -> dict[str, Any]:
        return prepared.unwrapped.state_dict()


def register(host: PluginHost) -> None:
    """Add the process and training defaults to ``host`` (once): what a training run calls."""
    process.register(host)
    host.register_default(TrainingDefaults(), NAME)


__all__ = ["NAME", "TrainingDefaults", "register"]
