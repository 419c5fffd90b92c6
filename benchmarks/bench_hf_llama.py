"""B20: a transformers ``LlamaForCausalLM`` (~100M parameters, built from a ``LlamaConfig``, nothing
downloaded) trained through the fsdp plugin from the model's own tensor-parallel plan ÷ the same
parallelization written by hand with torch's APIs.

torchrig side: ``Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(tp_size=2[,
dp_shard_size=2]))`` with no ``tp_plan`` (the plan is the model's ``_tp_plan``/``base_model_tp_plan``,
translated by the plugin), ``prepare(model, optimizer, loader)``. Hand-written side:
``init_device_mesh``, ``parallelize_module`` over the ``tp`` sub-mesh with the torch styles
transformers' Llama plan stands for (:func:`hand_plan`: ``colwise`` → ``ColwiseParallel()``,
``rowwise`` → ``RowwiseParallel()``, the head's ``colwise_gather_output`` →
``ColwiseParallel(output_layouts=Replicate())``, the embedding's ``embedding_rowwise`` →
``RowwiseParallel(input_layouts=Replicate())``), then (FSDP2 × TP) ``fully_shard`` per decoder layer
and at the root over ``dp_shard``; a plain ``DataLoader`` with a ``DistributedSampler`` over the
data-parallel ranks. Both: the same tokens (a tp group's ranks read the same batches), torch AdamW,
``model(input_ids=x, labels=x).loss``.

Procedure: B13's (``bench_mesh.py``): each trial starts fresh worker processes, builds ``--copies``
copies of each side alternately (ABBA; the side built first alternates between trials), trains them
in interleaved rounds (order reversed every round); a round's rate per side is the mean over its
copies; the ratio is the geometric mean over trials of the median per-round ratio (worst rank),
printed with each trial's ratio and a 95% bootstrap interval of the pooled per-round ratios.

B20             TP 2 on 2 CPU ranks, fp32, tokens/s ratio ≥ 0.98.
B20 FSDP2×TP    dp_shard 2 × tp 2 on 4 CPU ranks, fp32, ≥ 0.98.
B20 GPU         (``--device cuda``) a ~1B Llama on one GPU, bf16: the fsdp strategy at world 1 (which
                leaves one process's model whole and autocasts, as docs/fsdp.md says) ÷ the same
                written by hand (autocast bf16, AdamW); tokens/s, the ratio and MFU. Skipped without
                a CUDA GPU.

    python benchmarks/bench_hf_llama.py [--only B20,B20-FSDP2xTP] [--trials 2] [--copies 1] [--rounds 4] [--steps 1]
    python benchmarks/bench_hf_llama.py --device cuda [--rounds 6] [--steps 4]
    python benchmarks/bench_hf_llama.py --smoke   # both CPU rows' code path on a tiny Llama: not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

import torch
from _report import emit
from _stats import combine_trials, interleaved_rates
from bench_mesh import report

GOAL = 0.98
#: ~100M parameters: 24.6M embedding + 24.6M head + 8 layers × 6.3M (GQA: 4 key/value heads).
HUNDRED_M = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
             "num_attention_heads": 12, "num_key_value_heads": 4, "seq": 128}
#: ~1B parameters (TinyLlama-like widths, 18 layers) for the GPU row.
ONE_BILLION = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 18,
               "num_attention_heads": 16, "num_key_value_heads": 8, "seq": 2048}
#: ``--smoke``: the code path only.
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "seq": 16}
#: (row id, (dp_shard, tp), what) of the CPU rows; ``--only`` also takes "B20-FSDP2xTP".
CPU_ROWS = (("B20", (1, 2), "TP 2"), ("B20 FSDP2×TP", (2, 2), "FSDP2×TP"))


def build_llama(config: dict, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    fields = {key: value for key, value in config.items() if key != "seq"}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, max_position_embeddings=config["seq"]))


def hand_plan(model: torch.nn.Module) -> dict:
    """transformers' Llama plan (the instance's ``_tp_plan``: the class's, the config's
    ``base_model_tp_plan`` and the vocabulary-split embedding) written with torch's styles, module by module."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate()),
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def dataset(config: dict, samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randint(0, config["vocab_size"], (samples, config["seq"]),
                                                        generator=generator))


def _endless(loader):
    while True:
        yield from loader


def _stepper(model, optimizer, loader, device: torch.device, backward=None, autocast: bool = False):
    batches = _endless(loader)

    def step() -> int:
        (tokens,) = next(batches)
        tokens = tokens.to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=tokens, labels=tokens).loss
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens.numel()

    return step


def hand_written(model, data, batch: int, device: torch.device, sizes: tuple[int, int], bf16: bool):
    dp_shard, tp = sizes
    model = model.to(device)
    if dp_shard * tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], hand_plan(model))
        if dp_shard > 1:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
        dp_rank = mesh["dp_shard"].get_local_rank()
    else:
        dp_rank = 0
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp_shard, rank=dp_rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return _stepper(model, optimizer, loader, device, autocast=bf16)


def with_torchrig(model, data, batch: int, device: torch.device, sizes: tuple[int, int], bf16: bool):
    from torchrig import Accelerator, ParallelismConfig

    dp_shard, tp = sizes
    parallelism = ParallelismConfig(tp_size=tp, dp_shard_size=dp_shard) if dp_shard * tp > 1 else None
    accelerator = Accelerator(cpu=device.type == "cpu", strategy="fsdp", mixed_precision="bf16" if bf16 else "no",
                              parallelism_config=parallelism)
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loader)
    return _stepper(model, optimizer, loader, device, backward=accelerator.backward)


def _rate(step, steps: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += step()
    if cuda:
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def task(ctx, config: dict, sizes: tuple[int, int], batch: int, rounds: int, steps: int, use_cuda: bool,
         rig_first: bool, copies: int, control: bool, bf16: bool) -> dict:
    """One trial on one rank: per-round tokens/s of both sides (``bench_mesh.task``'s procedure)."""
    from torchrig.testing.contracts import rank_environment
    from torchrig.tracking.throughput import estimate_flops_per_token

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
        device = torch.device("cuda", ctx.rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        base = build_llama(config)
        flops = estimate_flops_per_token(base, config["seq"])
        params = sum(p.numel() for p in base.parameters())
        data = dataset(config, samples=batch * sizes[0] * 8)  # 8 batches per rank and epoch

        def build(side: str, model: torch.nn.Module):
            make = with_torchrig if side == "rig" and not control else hand_written
            return side, make(model, data, batch, device, sizes, bf16)

        sides = ["rig", "hand"] if rig_first else ["hand", "rig"]
        order = [side for index in range(copies) for side in (sides if index % 2 == 0 else sides[::-1])]
        steppers = [build(side, copy.deepcopy(base)) for side in order]
        del base
        measured = interleaved_rates(steppers, rounds, lambda step: _rate(step, steps, use_cuda))
        return {**measured, "flops": flops, "params": params}


def measure(config: dict, sizes: tuple[int, int], batch: int, rounds: int, steps: int, use_cuda: bool, trials: int,
            copies: int, control: bool, bf16: bool) -> list[dict]:
    """Per rank: both sides' tokens/s, the geometric mean over ``trials`` (fresh processes each) of the
    median per-round ratio, every trial's ratio, and the pooled per-round ratios."""
    from torchrig.testing.pool import WorkerPool

    world = sizes[0] * sizes[1]
    runs = []
    for trial in range(trials):
        with WorkerPool(world_size=world, backend="nccl" if use_cuda else "gloo", collective_timeout=1800) as pool:
            runs.append(pool.run(task, config, sizes, batch, rounds, steps, use_cuda, trial % 2 == 1, copies, control,
                                 bf16, timeout=5400))
    return combine_trials(runs)


def _wanted(only: str) -> set[str]:
    return {item.strip().upper().replace("-FSDP2XTP", " FSDP2×TP").replace("-GPU", " GPU")
            for item in only.split(",") if item.strip()}


def cpu_rows(args: argparse.Namespace, wanted: set[str]) -> bool:
    config = TINY if args.smoke else HUNDRED_M
    note = " (measured under load)" if args.loaded else ""
    ok = True
    for bench_id, sizes, what in CPU_ROWS:
        if bench_id.upper() not in wanted:
            continue
        world = sizes[0] * sizes[1]
        print(f"{bench_id}: transformers Llama {what} (dp_shard {sizes[0]} × tp {sizes[1]}), {world} CPU ranks (gloo), "
              f"fp32, batch {args.batch} × {config['seq']} tokens per data-parallel rank, {args.trials} trials × "
              f"{args.copies} copies per side × {args.rounds} rounds × {args.steps} steps"
              f"{' — A/A control' if args.control else ''}{' — smoke: tiny model, not a measurement' if args.smoke else ''}",
              flush=True)
        results = measure(config, sizes, args.batch, args.rounds, args.steps, False, args.trials, args.copies,
                          args.control, bf16=False)
        print(f"  model: {results[0]['params'] / 1e6:.1f}M parameters")
        what_row = f"transformers Llama ({results[0]['params'] / 1e6:.0f}M) fsdp plugin {what} from its own plan ÷ " \
                   f"hand-written {what}, tokens/s ({world} CPU ranks)"
        if args.smoke:  # the code path ran; a tiny model's ratio says nothing about the goal
            worst = min(results, key=lambda r: r["ratio"])
            for rank, r in enumerate(results):
                print(f"  rank {rank}: hand-written {r['hand']:,.0f} tokens/s, torchrig {r['rig']:,.0f} tokens/s")
            print(f"{bench_id} smoke: ratio {worst['ratio']:.3f} (tiny model, not a measurement)")
            emit(bench_id, what_row, f"smoke {worst['ratio']:.3f}: tiny model, not a measurement", f"≥ {GOAL}", None)
            continue
        ok = report(bench_id, what_row, results, GOAL, args.control, note) and ok
    if args.smoke:
        print("B20 smoke run finished (not a measurement)")
    return ok


def gpu_row(args: argparse.Namespace) -> bool:
    what = "~1B transformers Llama, fsdp strategy at world 1 bf16 ÷ hand-written (one GPU); MFU"
    if args.device != "cuda" or not torch.cuda.is_available():
        reason = "run it with --device cuda" if args.device != "cuda" else "no CUDA GPU"
        print(f"B20 GPU skipped: {reason}")
        emit("B20 GPU", what, "—", f"≥ {GOAL}", None)
        return True
    from torchrig.tracking.throughput import device_peak_flops

    results = measure(ONE_BILLION, (1, 1), args.gpu_batch, args.rounds, args.steps, True, args.trials, 1, args.control,
                      bf16=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops(torch.device("cuda", 0), "bf16")
    rate = results[0]["rig"]
    mfu = rate * results[0]["flops"] / peak if peak and results[0]["flops"] else None
    print(f"B20 GPU ({results[0]['params'] / 1e9:.2f}B parameters, batch {args.gpu_batch} × {ONE_BILLION['seq']}): "
          f"torchrig {rate:,.0f} tokens/s, hand-written {results[0]['hand']:,.0f}; MFU = tokens/s × "
          f"{results[0]['flops']:.3e} FLOPs/token / peak {peak or float('nan'):.3e} = "
          f"{mfu if mfu is not None else float('nan'):.1%}")
    return report("B20 GPU", what, results, GOAL, args.control, f"; MFU {mfu:.0%}" if mfu is not None else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="B20,B20-FSDP2xTP,B20-GPU")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU row (~1B, one GPU) instead of the CPU rows")
    parser.add_argument("--trials", type=int, default=2, help="independent trials, each in fresh processes")
    parser.add_argument("--copies", type=int, default=1, help="copies of each side per trial")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per trial")
    parser.add_argument("--steps", type=int, default=1, help="training steps per block")
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank (CPU rows)")
    parser.add_argument("--gpu-batch", type=int, default=4, help="sequences per step (GPU row)")
    parser.add_argument("--control", action="store_true", help="A/A: hand-written copies on both sides")
    parser.add_argument("--loaded", action="store_true", help="mark the CPU rows as measured on a shared machine")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="GPU peak (default: torchrig.tracking.throughput's table for the device, bf16)")
    parser.add_argument("--smoke", action="store_true", help="the CPU rows' code path on a tiny Llama: not a measurement")
    args = parser.parse_args()
    wanted = _wanted(args.only)
    if args.device == "cuda":
        return 0 if gpu_row(args) else 1
    ok = cpu_rows(args, wanted)
    if "B20 GPU" in wanted:  # reported as skipped: the GPU row runs with --device cuda
        ok = gpu_row(args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
