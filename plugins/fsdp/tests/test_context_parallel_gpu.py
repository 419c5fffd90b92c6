"""GPU tier: context parallel (ring attention through ``accelerator.maybe_context_parallel``) and async tensor
parallel on two CUDA ranks over NCCL, each against a one-process reference of the same model and data.

Skipped without two CUDA devices (torch 2.13 has no CPU kernel for either: the CPU attention op has no
sharding rule, and micro-pipeline TP uses CUDA symmetric memory). The CPU tier checks everything around them:
tests/accelerator/test_context_parallel.py, the cp layouts of test_mesh.py, and tests/config/test_parallelism.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import TP_PLAN, TinyLM, lm_data

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

TIMEOUT = 300
STEPS = 3


@pytest.fixture(scope="module")
def pool():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one rank each, NCCL)")
    from torchrig.testing.pool import WorkerPool

    workers = WorkerPool(world_size=2, backend="nccl")
    try:
        yield workers
    finally:
        workers.close()


def _reference(batch: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens, labels in torch.utils.data.DataLoader(lm_data(STEPS * batch), batch_size=batch):
        loss = model(tokens.cuda(), labels.cuda())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def _train_cp(ctx, load_balance: bool):
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ["LOCAL_RANK"] = str(ctx.rank)
        accelerator = Accelerator(strategy="fsdp", parallelism_config={"cp_size": 2, "cp_load_balance": load_balance})
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(STEPS * 2), batch_size=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for tokens, labels in loader:
            with accelerator.maybe_context_parallel(buffers=[tokens, labels], buffer_seq_dims=[1, 1],
                                                    no_restore_buffers={tokens, labels}):
                loss = model(tokens, labels)  # this rank's chunk of the sequence
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))  # equal chunks: the mean is the loss
        params = {n: p.detach().full_tensor().cpu() for n, p in accelerator.unwrap_model(model).named_parameters()}
        return losses, params


@pytest.mark.parametrize("load_balance", [True, False])
def test_context_parallel_trains_like_one_process(pool, load_balance):
    reference = _reference(2)
    for losses, params in pool.run(_train_cp, load_balance, timeout=TIMEOUT):
        assert losses == pytest.approx(reference["losses"], rel=1e-3)
        for name, expected in reference["params"].items():
            torch.testing.assert_close(params[name], expected, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _refusals(ctx):
    from torchrig import Accelerator
    from torchrig.errors import ConfigError

    class Eager(torch.nn.Module):  # attention written out: never reaches SDPA, so nothing would be ring attention
        def forward(self, x):
            scores = (x @ x.transpose(-1, -2)).softmax(-1)
            return scores @ x

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ["LOCAL_RANK"] = str(ctx.rank)
        accelerator = Accelerator(strategy="fsdp", parallelism_config={"cp_size": 2})
        messages = []
        x = torch.randn(1, 16, 8, device=accelerator.device)
        for body in (lambda: Eager()(x.unsqueeze(1)),
                     lambda: torch.nn.functional.scaled_dot_product_attention(
                         *(x.unsqueeze(1),) * 3, attn_mask=torch.ones(16, 16, dtype=torch.bool, device=x.device))):
            try:
                with accelerator.maybe_context_parallel(buffers=[x.clone()], buffer_seq_dims=[1]):
                    body()
            except ConfigError as exc:
                messages.append(str(exc))
        return messages


def test_attention_context_parallel_would_get_wrong_is_refused(pool):
    for eager, masked in pool.run(_refusals, timeout=TIMEOUT):
        assert "no torch.nn.functional.scaled_dot_product_attention call ran inside the context" in eager
        assert "attn_mask: an explicit attention mask" in masked


def _train_async_tp(ctx):
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ["LOCAL_RANK"] = str(ctx.rank)
        accelerator = Accelerator(strategy="fsdp", dynamo_backend="inductor", mixed_precision="bf16",
                                  parallelism_config={"tp_size": 2, "tp_plan": TP_PLAN, "async_tp": True})
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(STEPS), batch_size=1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for tokens, labels in loader:
            loss = model(tokens, labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        group = accelerator.device_submeshes["tp"].get_group().group_name
        return losses, inductor_config._micro_pipeline_tp, is_symm_mem_enabled_for_group(group)


def test_async_tensor_parallel_turns_on_micro_pipeline_tp_and_trains(pool):
    reference = _reference(1)
    for losses, micro_pipeline, symmetric in pool.run(_train_async_tp, timeout=TIMEOUT):
        assert micro_pipeline and symmetric
        assert losses == pytest.approx(reference["losses"], rel=5e-2)  # bf16 autocast against fp32
