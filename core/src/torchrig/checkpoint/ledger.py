"""What a run checkpoints, stated explicitly: the ledger the Accelerator appends to and the
checkpoint manager reads.

Data flows one way: ``prepare`` and ``register_for_checkpointing`` append to the ledger; the
manager receives it and never reads the Accelerator (as torchtitan builds its checkpointer from
explicit state, and Fabric's ``save(path, state)`` takes it). Everything the save path needs —
the run (configuration, cluster, plugin host), the prepared objects in prepare order, the
registered objects and the accumulation counter — is here, and nothing else.
"""

from __future__ import annotations

from typing import Any

import attrs

from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext
from torchrig.plugin.types import PreparedModel
from torchrig.training.gradient_state import GradientState


@attrs.define(eq=False)
class CheckpointLedger:
    """The prepared and registered objects of one run, in the order their files are numbered."""

    run: RunContext
    #: The gradient-accumulation counter (saved as ``accumulation_step``, restored on load).
    gradient_state: GradientState
    #: Prepared models with their optimizers and schedulers, as the strategy handed them back.
    models: list[PreparedModel] = attrs.field(factory=list)
    #: The prepared optimizers (counted in the manifest; their state is the strategy's to save).
    optimizers: list[Any] = attrs.field(factory=list)
    #: The prepared schedulers (``scheduler.bin``, ``scheduler_1.bin``, …).
    schedulers: list[Any] = attrs.field(factory=list)
    #: The prepared dataloaders (their positions: ``dl_state_dict*.bin``).
    dataloaders: list[Any] = attrs.field(factory=list)
    #: Objects given to ``register_for_checkpointing`` (``custom_checkpoint_<i>.*``).
    custom_objects: list[Any] = attrs.field(factory=list)

    @property
    def host(self) -> PluginHost:
        """The plugin host whose hooks save and load the strategy's state."""
        if self.run.plugins is None:
            raise RuntimeError("this run has no plugin host: checkpoints need the run an Accelerator opened")
        return self.run.plugins

    def forget_prepared(self) -> None:
        """Drop the prepared objects (``free_memory``/``end_training``); registered ones stay."""
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()


__all__ = ["CheckpointLedger"]
