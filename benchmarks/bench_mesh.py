"""B13, B14 (CPU) and B15 (GPU): the fsdp plugin's tensor parallel and FSDP2 × TP ÷ the same
parallelization written by hand with torch's APIs.

Hand-written side: ``init_device_mesh``, ``parallelize_module`` with torch's styles over the ``tp``
sub-mesh, then (FSDP2 × TP) ``fully_shard`` per block and at the root over ``dp_shard``, AdamW built
on the parallelized parameters. torchrig side: ``Accelerator(strategy="fsdp", parallelism_config=
{tp_size, dp_shard_size, tp_plan})`` with the same plan as style names. Same model (a Llama-style
transformer: RMSNorm, SwiGLU, causal SDPA, untied head), same tokens (the ranks of one tp group
share them), same procedure as B9/B10 (``bench_gpu_sharded.measure``): each trial starts fresh
worker processes, builds ``--copies`` copies of each side alternately, in ABBA order (the side
built first alternates between trials too), trains them in interleaved rounds (order reversed
every round); a
round's rate per side is the mean over its copies; the ratio is the geometric mean over trials of
the median per-round ratio (worst rank), printed with each trial's ratio and a 95% bootstrap
interval of the pooled per-round ratios. ``--control`` builds hand-written copies on both sides.

B13  TP on 4 CPU ranks (tp 4), fp32, tokens/s ratio ≥ 0.98.
B14  FSDP2 × TP on 4 CPU ranks (dp_shard 2 × tp 2), fp32, ≥ 0.98.
B15  (GPU) ~1B Llama-style model, FSDP2 × TP (tp 2, dp_shard the rest) bf16 on every visible GPU:
     tokens/s of both sides, the ratio, and MFU (torchrig.tracking.throughput's 6·N + 12·L·d·T formula and
     peak table); skipped without two CUDA GPUs.

    python benchmarks/bench_mesh.py [--only B13,B14,B15] [--trials 2] [--copies 2] [--rounds 6] [--steps 2]
    python benchmarks/bench_mesh.py --cpu-smoke   # B15's code path (bf16) on 4 CPU ranks, not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys

import torch
from _report import emit
from _stats import bootstrap_ci, combine_trials, interleaved_rates
from bench_gpu import tokens_per_second
from torch import nn

GOAL, GPU_RATIO_GOAL = 0.98, 0.98
CPU = {"layers": 2, "dim": 128, "heads": 4, "ffn": 256, "vocab": 1024, "seq": 64}
ONE_BILLION = {"layers": 16, "dim": 2048, "heads": 16, "ffn": 5632, "vocab": 32000, "seq": 2048}
#: The plan as torchrig style names (parallelism_config.tp_plan) ...
PLAN = {"embed": "embedding", "blocks.*.attn.w[qkv]": "colwise", "blocks.*.attn.wo": "rowwise",
        "blocks.*.mlp.w[13]": "colwise", "blocks.*.mlp.w2": "rowwise", "head": "output"}


def hand_plan(model: nn.Module) -> dict:
    """... and the same plan written with torch's styles, module by module."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for index in range(len(model.blocks)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"blocks.{index}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"blocks.{index}.{name}"] = RowwiseParallel()
    return plan


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # local heads under tensor parallel: -1
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False), \
            nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, heads), MLP(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LlamaLike(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, ffn: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.n_layers, self.dim, self.seq = layers, dim, seq  # read by torchrig.tracking.throughput
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _stepper(model: nn.Module, optimizer: torch.optim.Optimizer, backward=None, autocast=None):
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = model(x, y)
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _policies(bf16: bool) -> tuple:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not bf16:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    block = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return block, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)  # torchrig's root policy for bf16


def hand_written(model: nn.Module, device: torch.device, sizes: tuple[int, int], bf16: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp_shard, tp = sizes
    mesh = init_device_mesh(device.type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    model = model.to(device)
    parallelize_module(model, mesh["tp"], hand_plan(model))
    if dp_shard > 1:
        block_policy, root_policy = _policies(bf16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=block_policy)
        fully_shard(model, mesh=mesh["dp_shard"], mp_policy=root_policy)
    # tensor parallel alone has no fully_shard to cast: bf16 is autocast then (as torchrig's precision plugin)
    autocast = (lambda: torch.autocast(device.type, torch.bfloat16)) if bf16 and dp_shard == 1 else None
    return _stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-4), autocast=autocast)


def with_torchrig(model: nn.Module, device: torch.device, sizes: tuple[int, int], bf16: bool):
    from torchrig import Accelerator, FullyShardedDataParallelPlugin

    dp_shard, tp = sizes
    accelerator = Accelerator(cpu=device.type == "cpu", strategy="fsdp", mixed_precision="bf16" if bf16 else "no",
                              parallelism_config={"dp_shard_size": dp_shard, "tp_size": tp, "tp_plan": PLAN},
                              fsdp_plugin=FullyShardedDataParallelPlugin(
                                  auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=["Block"]))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return _stepper(model, optimizer, accelerator.backward)


def task(ctx, config: dict, sizes: tuple[int, int], batch: int, rounds: int, steps: int, use_cuda: bool,
         rig_first: bool, copies: int, control: bool, bf16: bool) -> dict:
    """One trial on one rank (``bench_gpu_sharded.task``'s procedure): per-round rates of both sides."""
    from torchrig.testing.contracts import rank_environment

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
        device = torch.device("cuda", ctx.rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        torch.manual_seed(0)
        base = LlamaLike(**config)
        from torchrig.tracking.throughput import estimate_flops_per_token

        flops = estimate_flops_per_token(base, config["seq"])
        generator = torch.Generator().manual_seed(ctx.rank // sizes[1])  # the ranks of a tp group share tokens
        tokens = [tuple(torch.randint(0, config["vocab"], (batch, config["seq"]), generator=generator).to(device)
                        for _ in range(2)) for _ in range(2)]

        def build(side: str, model: nn.Module):
            make = with_torchrig if side == "rig" and not control else hand_written
            return side, make(model, device, sizes, bf16)

        sides = ["rig", "hand"] if rig_first else ["hand", "rig"]
        # ABBA: the order of each pair of copies is reversed for the next pair, so that within a trial
        # each side has as many copies built first as built second (on this CPU the copy built
        # second of a pair ran up to 7% faster, whichever side it was)
        order = [side for index in range(copies) for side in (sides if index % 2 == 0 else sides[::-1])]
        steppers = [build(side, copy.deepcopy(base)) for side in order]
        del base
        measured = interleaved_rates(steppers, rounds, lambda step: tokens_per_second(step, tokens, steps))
        return {**measured, "flops": flops}


def measure(config: dict, sizes: tuple[int, int], batch: int, rounds: int, steps: int, use_cuda: bool, trials: int,
            copies: int, control: bool, bf16: bool) -> list[dict]:
    """Per rank: both sides' tokens/s, the geometric mean over ``trials`` (fresh processes each) of
    the median per-round ratio, every trial's ratio, and the pooled per-round ratios."""
    from torchrig.testing.pool import WorkerPool

    world = sizes[0] * sizes[1]
    runs = []
    for trial in range(trials):
        with WorkerPool(world_size=world, backend="nccl" if use_cuda else "gloo", collective_timeout=600) as pool:
            runs.append(pool.run(task, config, sizes, batch, rounds, steps, use_cuda, trial % 2 == 1, copies, control,
                                 bf16, timeout=3600))
    return combine_trials(runs)


def report(bench_id: str, what: str, results: list[dict], goal: float, control: bool, load_note: str) -> bool:
    worst = min(results, key=lambda r: r["ratio"])
    low, high = bootstrap_ci(worst["ratios"])
    trials = " ".join(f"{t:.3f}" for t in worst["trials"])
    for rank, r in enumerate(results):
        print(f"  rank {rank}: hand-written {r['hand']:,.0f} tokens/s, torchrig {r['rig']:,.0f} tokens/s, "
              f"ratio {r['ratio']:.3f} (trials {' '.join(f'{t:.3f}' for t in r['trials'])})")
    if control:
        print(f"{bench_id} A/A control ratio (worst rank) {worst['ratio']:.3f} [{low:.3f}, {high:.3f}]: no goal")
        return True
    ok = worst["ratio"] >= goal
    print(f"{bench_id} ratio (worst rank) {worst['ratio']:.3f}, 95% interval of per-round ratios [{low:.3f}, "
          f"{high:.3f}] (goal ≥ {goal}): {'PASS' if ok else 'FAIL'}")
    emit(bench_id, what, f"{worst['ratio']:.3f} [{low:.3f}, {high:.3f}] (trials {trials}){load_note}", f"≥ {goal}", ok)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="B13,B14,B15")
    parser.add_argument("--trials", type=int, default=2, help="independent trials, each in fresh processes")
    parser.add_argument("--copies", type=int, default=2, help="copies of each side per trial")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per trial")
    parser.add_argument("--steps", type=int, default=2, help="training steps per block")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--control", action="store_true", help="A/A: hand-written copies on both sides")
    parser.add_argument("--loaded", action="store_true",
                        help="mark the CPU rows as measured on a machine shared with other work")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="GPU peak (default: torchrig.tracking.throughput's table for the device, bf16)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run B15's code path (bf16 policies) on 4 CPU ranks with the small model: not a measurement")
    args = parser.parse_args()
    if args.cpu_smoke:
        return gpu_row(args, smoke=True) and 0
    wanted = {i.strip().upper() for i in args.only.split(",") if i.strip()}
    note = " (measured under load)" if args.loaded else ""
    ok = True
    for bench_id, sizes, what in (("B13", (1, 4), "TP"), ("B14", (2, 2), "FSDP2×TP")):
        if bench_id not in wanted:
            continue
        print(f"{bench_id} {what} (dp_shard {sizes[0]} × tp {sizes[1]}), 4 CPU ranks (gloo), fp32, {args.trials} "
              f"trials × {args.copies} copies per side × {args.rounds} rounds × {args.steps} steps"
              f"{' — A/A control' if args.control else ''}")
        results = measure(CPU, sizes, args.batch, args.rounds, args.steps, False, args.trials, args.copies,
                          args.control, bf16=False)
        ok = report(bench_id, f"fsdp plugin {what} ÷ hand-written {what}, tokens/s (4 CPU ranks)", results, GOAL,
                    args.control, note) and ok
    if "B15" in wanted:
        ok = gpu_row(args) and ok
    return 0 if ok else 1


def gpu_row(args: argparse.Namespace, smoke: bool = False) -> bool:
    what = "~1B Llama, FSDP2×TP bf16 ÷ hand-written (GPU); MFU"
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if smoke:
        results = measure(CPU, (2, 2), 2, 2, 1, False, 1, 1, False, bf16=True)
        print(f"B15 CPU smoke: torchrig {results[0]['rig']:,.0f} tokens/s, hand-written {results[0]['hand']:,.0f}, "
              f"{results[0]['flops']:.3e} FLOPs/token; B15 CPU smoke run finished (not a measurement)")
        return True
    if world < 2:
        print(f"B15 skipped: needs two CUDA GPUs (tp 2), found {world}")
        emit("B15", what, "—", f"≥ {GPU_RATIO_GOAL}", None)
        return True
    from torchrig.tracking.throughput import device_peak_flops

    sizes = (world // 2, 2)
    results = measure(ONE_BILLION, sizes, 2, args.rounds, args.steps, True, args.trials, 1, args.control, bf16=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops(torch.device("cuda", 0), "bf16")
    rate = statistics.median(r["rig"] for r in results)
    tokens_per_gpu = rate / sizes[1]  # the tp ranks of a group process the same tokens
    mfu = tokens_per_gpu * results[0]["flops"] / peak if peak else None
    print(f"B15 {world} GPUs (dp_shard {sizes[0]} × tp {sizes[1]}): torchrig {rate:,.0f} tokens/s per tp group, "
          f"hand-written {statistics.median(r['hand'] for r in results):,.0f}; MFU = {tokens_per_gpu:,.0f} tokens/s "
          f"per GPU × {results[0]['flops']:.3e} FLOPs/token / peak {peak or float('nan'):.3e} = "
          f"{mfu if mfu is not None else float('nan'):.1%}")
    ok = report("B15", what, results, GPU_RATIO_GOAL, args.control, f"; MFU {mfu:.0%}" if mfu is not None else "")
    return ok


if __name__ == "__main__":
    sys.exit(main())
