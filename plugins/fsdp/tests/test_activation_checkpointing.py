"""Activation checkpointing policies and activation offload under the fsdp strategy (issue 37), proven by
their effect: the bytes a forward leaves alive for backward (measured on the live storages, not predicted)
order as none > every_k > full and none > selective > full, the gradients equal the run without
checkpointing, recomputation happens where the policy says, offload hooks see the tensors of the chosen
blocks. One process (the fsdp strategy leaves a one-process model unsharded but still applies the policy)
and one pooled 2-rank FSDP2 run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torchrig.plugin import ConfigError
from torchrig.testing.contracts import rank_environment
from torchrig.testing.memory import bytes_held_since, live_storages, only_new_objects
from torchrig.testing.models import SEQ, TP_PLAN, VOCAB, LMBlock, PipeLM, TinyLM, lm_loss
from torchrig_fsdp.explain import FSDPConfigError
from torchrig_fsdp.options import FullyShardedDataParallelPlugin

TIMEOUT = 120
BLOCKS = 4


def make_model(seed: int = 0, blocks: int = BLOCKS) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    model.blocks = torch.nn.ModuleList(LMBlock() for _ in range(blocks))
    return model


def lm_batch(rank: int = 0, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(77 + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class CallCounter:
    """Counts each block's MLP forward calls: a checkpointed block runs its forward again in backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        blocks = [module for module in model.modules() if isinstance(module, LMBlock)]
        self.calls = [0] * len(blocks)
        for index, block in enumerate(blocks):
            block.mlp.register_forward_pre_hook(self._hook(index))  # recompute stops early: before forward hooks

    def _hook(self, index: int):
        def hook(*_):
            self.calls[index] += 1
        return hook


def prepared(**fsdp_config):
    from torchrig import Accelerator

    accelerator = Accelerator(cpu=True, strategy="fsdp", fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_config))
    model = make_model()
    counter = CallCounter(model)
    return accelerator, accelerator.prepare(model), counter


def held_and_grads(**fsdp_config) -> tuple[int, dict[str, torch.Tensor], list[int]]:
    """Bytes alive after one forward (what backward will read), the gradients, each block's forward calls."""
    with only_new_objects():  # the run made inside: nothing of it stays frozen
        _, model, counter = prepared(**fsdp_config)
        tokens, labels = lm_batch()
        baseline = live_storages()
        loss = model(tokens, labels)
        held = bytes_held_since(baseline)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return held, grads, counter.calls


def test_policies_hold_fewer_bytes_as_predicted_and_leave_gradients_equal():
    results = {name: held_and_grads(**config) for name, config in {
        "none": {},
        "full": {"activation_checkpointing": True},
        "every_k": {"activation_checkpointing_policy": "every_k", "activation_checkpointing_every_k": 2},
        "selective": {"activation_checkpointing_policy": "selective"},
        "every_other_matmul": {"activation_checkpointing_policy": "selective",
                               "activation_checkpointing_matmul_every_k": 2},
    }.items()}
    held = {name: result[0] for name, result in results.items()}
    assert held["none"] > held["every_k"] > held["full"], held
    assert held["none"] > held["selective"] > held["every_other_matmul"] > held["full"], held
    # every_k 2 checkpoints blocks 2 and 4 (1-based, as torchtitan counts): half the blocks' activations go
    per_block = (held["none"] - held["full"]) / BLOCKS
    assert abs((held["none"] - held["every_k"]) - 2 * per_block) < 0.25 * per_block, held
    for name, (_, grads, _) in results.items():
        for key, grad in results["none"][1].items():
            torch.testing.assert_close(grads[key], grad, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
    calls = {name: result[2] for name, result in results.items()}
    assert calls["none"] == [1, 1, 1, 1]
    assert calls["full"] == [2, 2, 2, 2]  # recomputed in backward
    assert calls["every_k"] == [1, 2, 1, 2]
    assert calls["selective"] == [2, 2, 2, 2]  # the non-matmul ops are recomputed


def test_activation_offload_packs_the_chosen_blocks_saved_tensors_and_leaves_gradients_equal():
    from torchrig_fsdp.activation_checkpointing import offload_stats

    _, reference, _ = held_and_grads()
    _, model, _ = prepared(activation_offload=True, activation_offload_every_k=2)
    tokens, labels = lm_batch()
    model(tokens, labels).backward()
    packed = [offload_stats(block).packed for block in model.blocks]
    assert packed[0] == packed[2] == 0 and packed[1] > 0 and packed[3] > 0, packed
    assert packed[1] == packed[3]  # same block, same saved tensors
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name])
    # under full checkpointing a block keeps its input alone: that is what the hooks move
    _, model, _ = prepared(activation_checkpointing=True, activation_offload=True)
    model(tokens, labels).backward()
    input_bytes = tokens.numel() * model.embed.embedding_dim * 4
    assert [(offload_stats(b).packed, offload_stats(b).bytes) for b in model.blocks] == [(1, input_bytes)] * BLOCKS
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned CPU memory and device copies need CUDA")
def test_offloaded_tensors_sit_in_pinned_cpu_memory_on_gpu():
    from torchrig_fsdp.activation_checkpointing import offload_forward, offload_stats

    block = LMBlock().cuda()
    offload_forward(block)
    x = torch.randn(2, SEQ, 32, device="cuda", requires_grad=True)
    out = block(x)
    stats = offload_stats(block)
    assert stats.packed > 0 and stats.pinned == stats.packed and stats.bytes > 0
    out.sum().backward()  # the saved tensors come back to the device
    assert x.grad is not None and x.grad.is_cuda


def compiled_saved_bytes(**config) -> tuple[int, dict[str, torch.Tensor], torch.nn.Module]:
    """Bytes the compiled forward saves for backward (the partitioner's choice), the gradients, the model. The
    ``aot_eager_decomp_partition`` backend runs the min-cut partitioner inductor uses, without code generation."""
    from torchrig import Accelerator
    from torchrig.plugin import TorchDynamoPlugin

    torch._dynamo.reset()
    gc.collect()
    accelerator = Accelerator(cpu=True, strategy="fsdp", fsdp_plugin=FullyShardedDataParallelPlugin(**config),
                              dynamo_plugin=TorchDynamoPlugin(backend="aot_eager_decomp_partition"))
    model = accelerator.prepare(make_model(blocks=1))  # one block: the compile is the cost
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(*lm_batch())
    loss.backward()
    return saved[0], {name: p.grad.detach().clone() for name, p in model.named_parameters()}, model


def test_memory_budget_makes_the_compiled_step_save_less_is_refused_without_compile_and_policies_compile():
    import torch._functorch.config as functorch_config

    config = {"activation_checkpointing_policy": "memory_budget", "activation_checkpointing_memory_budget": 0.25}
    with pytest.raises(ConfigError, match="activation_checkpointing_memory_budget.*torch.compile.*dynamo_config"):
        prepared(**config)
    from torchrig_fsdp.activation_checkpointing import offload_stats

    before = functorch_config.activation_memory_budget
    try:
        kept, reference, _ = compiled_saved_bytes()
        recomputed, budget_grads, _ = compiled_saved_bytes(**config | {"activation_checkpointing_memory_budget": 0.0})
        assert functorch_config.activation_memory_budget == 0.0
    finally:
        functorch_config.activation_memory_budget = before
    try:  # the eager policies and offload compose with compile too
        _, selective_grads, model = compiled_saved_bytes(activation_checkpointing_policy="selective",
                                                         activation_offload=True)
    finally:
        torch._dynamo.reset()
    assert recomputed < 0.8 * kept, (recomputed, kept)
    # compiled, the checkpointed region saves what its policy keeps through autograd, so the hooks see all of it
    assert offload_stats(model.blocks[0]).packed > 1
    for name, grad in reference.items():
        torch.testing.assert_close(budget_grads[name], grad)
        torch.testing.assert_close(selective_grads[name], grad)


def test_options_their_policy_does_not_read_and_every_k_beyond_the_blocks_are_refused():
    with pytest.raises(ConfigError) as info:
        prepared(activation_checkpointing_policy="selective", activation_checkpointing_every_k=3,
                 activation_checkpointing_memory_budget=0.5)
    problems = "\n".join(info.value.problems)
    assert "fsdp_config.activation_checkpointing_every_k" in problems and "policy is selective" in problems
    assert "fsdp_config.activation_checkpointing_memory_budget" in problems
    with pytest.raises(FSDPConfigError, match="activation_checkpointing_every_k .5. is larger than .* blocks .4."):
        prepared(activation_checkpointing_policy="every_k", activation_checkpointing_every_k=5)
    with pytest.raises(ConfigError, match="activation_offload_every_k.*activation_offload: true"):
        prepared(activation_offload_every_k=2)
    with pytest.raises(FSDPConfigError, match="has none: set transformer_layer_cls_to_wrap"):
        prepared(activation_checkpointing=True, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=0)  # root only
    with pytest.raises(ConfigError, match="activation_checkpointing_policy.*NO_WRAP"):
        prepared(activation_checkpointing_policy="every_k", auto_wrap_policy="NO_WRAP")


@pytest.mark.multiprocess
def test_launch_refuses_memory_budget_without_compile_and_offload_without_blocks_with_exit_2(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(textwrap.dedent("""\
        distributed_type: FSDP
        use_cpu: true
        num_processes: 2
        fsdp_config:
          fsdp_activation_checkpointing_policy: memory_budget
          fsdp_activation_checkpointing_memory_budget: 0.5
        """))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--config_file", str(config), str(script)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fsdp_config.activation_checkpointing_memory_budget" in result.stderr and "--dynamo_backend" in result.stderr
    assert "Traceback" not in result.stderr and "must not start" not in result.stderr
    # Accelerate's offload flag sets activation_offload, which NO_WRAP leaves nothing to act on
    config.write_text("distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n"
                      "  fsdp_auto_wrap_policy: NO_WRAP\n")
    result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--config_file", str(config),
                             "--fsdp_activation_checkpointing_offload", "true", str(script)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fsdp_config.activation_offload (flag --fsdp_activation_checkpointing_offload)" in result.stderr
    assert "NO_WRAP" in result.stderr and "Traceback" not in result.stderr


# -- FSDP2 on two ranks ----------------------------------------------------------------------------------


def _train_two_ranks(ctx, fsdp_config):
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        accelerator = Accelerator(cpu=True, strategy="fsdp", fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_config))
        model = make_model()
        counter = CallCounter(model)
        model = accelerator.prepare(model)
        from torchrig_fsdp.activation_checkpointing import offload_stats

        tokens, labels = lm_batch(ctx.rank)
        accelerator.backward(model(tokens, labels))
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                 for name, p in model.named_parameters()}
        return {"calls": counter.calls, "grads": grads, "sharded": type(next(model.parameters())).__name__,
                "packed": [offload_stats(block).packed for block in model.blocks]}


def test_policy_and_offload_apply_under_fsdp2_on_two_ranks(gloo_pool):
    results = gloo_pool.run(_train_two_ranks, {"activation_checkpointing_policy": "every_k",
                                               "activation_checkpointing_every_k": 2,
                                               "activation_offload": True}, timeout=TIMEOUT)
    reference = make_model()
    for rank in range(2):
        reference(*lm_batch(rank)).div(2).backward()
    for result in results:
        assert result["sharded"] == "DTensor"
        assert result["calls"] == [1, 2, 1, 2]
        # blocks 2 and 4 are checkpointed: the offload hooks see the one input each keeps; blocks 1 and 3 save all
        assert result["packed"][0] == result["packed"][2] > 1 and result["packed"][1] == result["packed"][3] == 1
        for name, p in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], p.grad, atol=1e-5, rtol=1e-4)


def _composed(ctx, parallelism, fsdp_config):
    """One step under ``parallelism_config`` (tensor parallel alone, or a 2-stage pipeline): each block's forward
    calls on this rank and the full gradients of the parameters it holds."""
    from torchrig import Accelerator, ParallelismConfig

    pipelined = "pp_size" in parallelism
    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        accelerator = Accelerator(cpu=True, strategy="fsdp", fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_config),
                                  parallelism_config=ParallelismConfig(**parallelism))
        torch.manual_seed(0)
        model = PipeLM() if pipelined else make_model()
        counter = CallCounter(model)
        model = accelerator.prepare(model)
        tokens, labels = lm_batch()
        accelerator.backward(model(tokens, target=labels) if pipelined else model(tokens, labels))
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                 for name, p in accelerator.unwrap_model(model).named_parameters() if p.grad is not None}
        return {"calls": counter.calls, "grads": grads}


def test_policies_apply_to_each_pipeline_stage_and_under_tensor_parallel_alone(gloo_pool):
    piped = gloo_pool.run(_composed, {"pp_size": 2, "pp_split_points": ["layers.2"], "pp_loss_fn": lm_loss},
                          {"activation_checkpointing_policy": "every_k"}, timeout=TIMEOUT)
    # each stage counts its own blocks: its 2nd block is checkpointed and runs again in backward, its 1st does not
    # (the schedule's calls: a shape probe, then one per micro-batch)
    (first, second, *_), (*_, third, fourth) = piped[0]["calls"], piped[1]["calls"]
    assert first == third and second > first and fourth > third, [r["calls"] for r in piped]
    torch.manual_seed(0)
    reference = PipeLM()
    tokens, labels = lm_batch()
    lm_loss(reference(tokens), labels).backward()
    for result in piped:
        assert result["grads"]
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, atol=1e-5, rtol=1e-4)
    tensor_parallel = gloo_pool.run(_composed, {"tp_size": 2, "tp_plan": TP_PLAN},
                                    {"activation_checkpointing_policy": "selective",
                                     "activation_checkpointing_matmul_every_k": 2}, timeout=TIMEOUT)
    reference = make_model()
    reference(tokens, labels).backward()
    for result in tensor_parallel:
        assert result["calls"] == [2] * BLOCKS
        for name, p in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], p.grad, atol=1e-5, rtol=1e-4)


def test_policies_apply_to_a_transformers_llama_with_its_key_value_cache_turned_off():
    """A transformers model caches keys/values in forward by default (``config.use_cache``): a checkpointed
    layer would recompute against the updated cache (selective checkpointing refuses: "not found in
    storage"). The policies turn the cache off, as transformers' own gradient checkpointing does."""
    from torchrig import Accelerator
    from torchrig.testing.hf_models import build, make_data

    tokens = make_data(4)[:][0]

    def run(**fsdp_config):
        accelerator = Accelerator(cpu=True, strategy="fsdp", fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_config))
        model = accelerator.prepare(build("llama"))
        calls = []
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        model(input_ids=tokens, labels=tokens).loss.backward()
        return model, len(calls), {name: p.grad.detach().clone() for name, p in model.named_parameters()}

    reference, plain_calls, expected = run()
    assert reference.config.use_cache is True  # left alone without checkpointing
    model, calls, grads = run(activation_checkpointing_policy="selective")
    assert model.config.use_cache is False
    assert calls == 2 * plain_calls  # every layer recomputed its cheap ops in backward
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
