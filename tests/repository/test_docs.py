"""The documentation lists what the code accepts."""

from __future__ import annotations

import pathlib

from torchrig.config.compat import ACCELERATE_KEYS
from torchrig.config.readers import env_name
from torchrig.config.resolve import Schema
from torchrig.testing import make_host

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
#: The configuration reference covers torchrig's own distributions (not examples/localsgd's plugin).
FIRST_PARTY = ("torchrig", "torchrig-ddp", "torchrig-fsdp", "torchrig-deepspeed", "torchrig-trackers",
               "torchrig-ray", "torchrig-fp8", "torchrig-ft")


def first_party_host():
    others = [info.key for info in make_host().plugins()
              if all(record.distribution not in FIRST_PARTY for record in info.records)]
    return make_host(disabled=others)


def test_configuration_reference_lists_every_key_variable_and_accelerate_key():
    text = (DOCS / "configuration.md").read_text()
    schema = Schema(first_party_host())
    missing = [key for key in schema.all_keys() if f"`{key}`" not in text]
    missing += [env_name(key) for key in schema.all_keys() if schema.spec(key).info.env and not schema.spec(key).info.python_only
                and env_name(key) not in text]
    missing += [entry.key for entry in ACCELERATE_KEYS if f"`{entry.key}`" not in text]
    assert not missing, f"docs/configuration.md is stale; run `python docs/gen_config_reference.py`: {missing}"
