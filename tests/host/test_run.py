"""RunContext.config is the run's ResolvedConfig, read one way (issue 35, "One way to read configuration").

A plain mapping is refused where a run is built, naming the fix; sections are read by their
options class (the core's top-level keys too, as ``CoreOptions``); whether the user set a key is a
typed question (``run.config.is_set``), not a ``getattr`` probe.
"""

from __future__ import annotations

import pytest
from torchrig.config.sources import Layer
from torchrig.host.run import RunContext
from torchrig.plugin import CoreOptions, DataLoaderConfiguration, ParallelismConfig
from torchrig.testing import make_host, resolved_config


@pytest.fixture(scope="module")
def host():
    return make_host()


def test_a_plain_mapping_is_refused_naming_the_resolved_configuration() -> None:
    with pytest.raises(TypeError, match=r"RunContext\(config=\.\.\.\) takes the run's ResolvedConfig, not a dict.*"
                                        r"resolve_config\(host.*torchrig\.testing\.resolved_config"):
        RunContext(config={"mixed_precision": "bf16"})


def test_sections_are_read_by_their_class_the_top_level_keys_as_core_options(host) -> None:
    run = RunContext(config=resolved_config({"mixed_precision": "bf16", "dataloader_config.split_batches": True},
                                            host=host))
    assert run.section(CoreOptions).mixed_precision == "bf16"
    assert run.section(CoreOptions).gradient_accumulation_steps == 1  # the default, declared once on the class
    assert run.section(DataLoaderConfiguration).split_batches is True
    assert run.section(ParallelismConfig).tp_size == 1


def test_whether_a_key_was_set_is_asked_of_the_typed_configuration(host) -> None:
    run = RunContext(config=resolved_config({"gradient_accumulation_steps": 4}, host=host))
    assert run.config.is_set("gradient_accumulation_steps") and not run.config.is_set("mixed_precision")
    assert run.option_source("gradient_accumulation_steps").layer is Layer.ARGUMENT
    assert run.option_source("mixed_precision").layer is Layer.DEFAULT
