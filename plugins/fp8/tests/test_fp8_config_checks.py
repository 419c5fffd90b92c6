"""fp8's validation reads its typed section: a Float8LinearConfig given as ``config`` replaces
recipe, pad_inner_dim and enable_fsdp_float8_all_gather, so any of them set away from the
options class's default beside it is refused by key; at their defaults they are not."""

from __future__ import annotations

import types

import pytest
from torchrig.plugin import ConfigError
from torchrig.testing import resolved_config
from torchrig_fp8.config_checks import REPLACED_BY_CONFIG
from torchrig_fp8.options import AORecipeKwargs

GIVEN = types.SimpleNamespace(emulate=True)  # stands for a torchao Float8LinearConfig(emulate=True)


def test_a_given_float8_config_alone_is_accepted_and_its_emulate_counts():
    config = resolved_config({"use_cpu": True, "mixed_precision": "fp8", "fp8_config": AORecipeKwargs(config=GIVEN)})
    assert config.section_of(AORecipeKwargs).config is GIVEN


@pytest.mark.parametrize(("field", "value"), [("recipe", "rowwise"), ("pad_inner_dim", True),
                                              ("enable_fsdp_float8_all_gather", False)])
def test_a_field_the_given_float8_config_replaces_is_refused_by_key(field, value):
    assert field in REPLACED_BY_CONFIG
    with pytest.raises(ConfigError) as caught:
        resolved_config({"use_cpu": True, "mixed_precision": "fp8",
                         "fp8_config": AORecipeKwargs(config=GIVEN, **{field: value})})
    assert f"fp8_config.{field}" in str(caught.value)
    assert "cannot take effect together with fp8_config.config" in str(caught.value)
