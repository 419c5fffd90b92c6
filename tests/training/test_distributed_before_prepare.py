"""A model distributed before ``prepare`` — by transformers' ``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=2))``, the path transformers 5 offers — is refused
with what to do, under DDP and under the fsdp strategy with a tp axis, instead of dying inside
torch's DDP broadcast ("mixed torch.Tensor and DTensor") or being sharded a second time.
2 gloo ranks (the shared pool); hard timeout, no process left behind."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180


def _prepare_a_model_transformers_distributed(ctx, root: str) -> dict:
    import gc

    from torchrig import Accelerator, ParallelismConfig
    from torchrig.errors import ConfigError
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    messages = {}
    with rank_environment(ctx.rank, ctx.world_size):
        for strategy, parallelism in (("ddp", None), ("fsdp", ParallelismConfig(tp_size=2))):
            model = AutoModelForCausalLM.from_pretrained(root, distributed_config=DistributedConfig(tp_size=2))
            accelerator = Accelerator(cpu=True, strategy=strategy, parallelism_config=parallelism)
            try:
                accelerator.prepare(model)
            except ConfigError as exc:
                messages[strategy] = str(exc)
            accelerator.free_memory()
            del accelerator, model
            gc.collect()  # one strategy per process at a time: end this Accelerator before the next
    return messages


def test_a_model_distributed_by_transformers_before_prepare_is_refused_with_what_to_do(gloo_pool, tmp_path):
    build("llama", seed=5).save_pretrained(tmp_path / "llama")
    results = gloo_pool.run(_prepare_a_model_transformers_distributed, str(tmp_path / "llama"), timeout=TIMEOUT)
    for rank, messages in enumerate(results):
        assert set(messages) == {"ddp", "fsdp"}, (rank, messages)
        for message in messages.values():
            assert "LlamaForCausalLM is already distributed" in message
            assert "DTensors (mesh" in message and "of shape (2,)" in message
            assert "distributed_config" in message and "parallelism_config" in message


def test_a_plain_model_is_not_refused():
    import torch
    from torchrig.training.conversion import refuse_distributed_model

    refuse_distributed_model(torch.nn.Linear(2, 2))  # no DTensor: nothing to say
    with pytest.raises(Exception, match="already distributed"):
        from torch.distributed.tensor import DeviceMesh, DTensor, Replicate

        with rank_environment(0, 1):
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
            try:
                mesh = DeviceMesh("cpu", [0])
                layer = torch.nn.Linear(2, 2)
                layer.weight = torch.nn.Parameter(DTensor.from_local(layer.weight.detach(), mesh, [Replicate()]))
                refuse_distributed_model(layer)
            finally:
                dist.destroy_process_group()
