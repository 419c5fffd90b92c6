"""torchrig.testing is a stable kit for plugin authors: its public names, the tiny run, and
contracts that fail when a plugin does not do what it declares."""

from __future__ import annotations

import inspect

import pytest
import torchrig.testing
from torchrig.plugin.types import ClusterInfo
from torchrig.testing import ClusterContract, PrecisionContract, StrategyContract, tiny_run


@pytest.mark.parametrize("name", torchrig.testing.__all__)
def test_every_public_name_resolves_and_is_documented(name):
    value = getattr(torchrig.testing, name)
    assert inspect.getdoc(value), f"torchrig.testing.{name} needs a docstring"


def test_contracts_keep_their_historic_import_path():
    from torchrig.testing.contracts import StrategyContract as Same
    from torchrig.testing.contracts import rank_environment  # noqa: F401  (tests of trackers import it)

    assert Same is StrategyContract


def test_tiny_run_trains_through_the_real_accelerator_and_records_hooks():
    result = tiny_run(mixed_precision="bf16", steps=4, gradient_accumulation_steps=2)
    assert len(result.losses) == 4 and result.skipped == [False, False]
    assert result.params_after != result.params_before
    assert result.owners["autocast"] == "precision:bf16"
    # prepare: capabilities, then the step plan (before the first model, whose forward gets the
    # plan's autocast), then the model: converted (no plugin here does), then wrapped
    result.hooks.assert_order(["torchrig_strategy_capabilities", "torchrig_precision_step_plan",
                               "torchrig_convert_model", "torchrig_prepare_model"], exact=True)


# -- the contracts can fail: a plugin that does not match what the subclass declares ---------


class _BF16ClaimingLossScaling(PrecisionContract):
    precision = "bf16"
    autocast_dtype = "bfloat16"
    scales_loss = True  # wrong: bf16 does not scale the loss


def test_precision_contract_fails_for_a_wrong_declaration(tmp_path):
    from torchrig import Accelerator
    from torchrig.testing.contracts._common import rank_environment

    with rank_environment(0, 1):
        accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
        with pytest.raises(AssertionError, match="must scale the gradients"):
            _BF16ClaimingLossScaling().test_gradients_are_scaled_only_by_a_loss_scaling_precision(accelerator)


class _FullPrecisionClaimingBF16(PrecisionContract):
    precision = "no"
    autocast_dtype = "bfloat16"  # wrong: the model's forward computes in fp32


def test_precision_contract_observes_the_prepared_forward(tmp_path):
    from torchrig import Accelerator
    from torchrig.testing.contracts._common import rank_environment

    with rank_environment(0, 1):
        accelerator = Accelerator(cpu=True, mixed_precision="no", project_dir=str(tmp_path))
        with pytest.raises(AssertionError, match="2 of 2 compute ops of the model did not run in torch.bfloat16"):
            _FullPrecisionClaimingBF16().test_the_prepared_forward_computes_in_its_dtype(accelerator)


class _Inconsistent:
    """A cluster plugin whose answer puts the rank outside the world."""

    def torchrig_detect_cluster(self, environ):
        return ClusterInfo(rank=4, world_size=4, local_world_size=4, master_addr="h", master_port=1, source="bad")


class _BadClusterContract(ClusterContract):
    cluster = "bad"
    environments = [({"X": "1"}, {"rank": 4})]


def test_cluster_contract_fails_for_an_inconsistent_answer():
    with pytest.raises(AssertionError):
        _BadClusterContract().test_answers_are_consistent(_Inconsistent())


class _LocalSGDIsNotSynchronous(StrategyContract):
    strategy = "localsgd"
    world_size = 2


@pytest.mark.multiprocess
def test_strategy_contract_fails_when_ranks_disagree(gloo_pool):
    from torchrig_localsgd.options import LocalSGDKwargs

    contract = _LocalSGDIsNotSynchronous()
    contract.options = {"kwargs_handlers": [LocalSGDKwargs(sync_every=3)]}

    def on_ranks(fn, *args, **kwargs):
        return gloo_pool.run(fn, *args, timeout=120, **kwargs)

    with pytest.raises(AssertionError, match="ranks disagree after one step"):
        contract.test_prepare_and_one_step_update_parameters_identically_on_all_ranks(on_ranks)
