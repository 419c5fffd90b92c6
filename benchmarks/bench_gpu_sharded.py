"""B8 (GPU): a ~1B-parameter GPT with the fsdp and deepspeed plugins ÷ hand-written equivalents.

On every visible GPU (one rank each, nccl, torchrig's worker pool), each rank trains two copies
of the same model on the same tokens in interleaved blocks: a hand-written one (FSDP2
``fully_shard`` per block and at the root with a bf16 ``MixedPrecisionPolicy``; or
``deepspeed.initialize`` with ZeRO-3 and bf16) and a torchrig one (``Accelerator(strategy=...)``
with the same settings). Which copy is built first is balanced: the comparison runs twice, in
fresh processes, hand-written first and then torchrig first, and the ratio is the geometric mean of
the two (see :func:`measure`). Reported per strategy: tokens/s of both (median of blocks), the ratio
(worst rank), and MFU = tokens/s per GPU × (6·N + 12·L·d·T) / peak (989 TFLOP/s dense bf16 for an
H100 SXM; ``--peak-tflops``). Goals: ratio ≥ 0.98, MFU ≥ 40%.

Without a CUDA GPU the rows are reported as skipped. ``--cpu-smoke`` runs a tiny configuration
on 2 CPU ranks over gloo to check the script itself (not a measurement).

    python benchmarks/bench_gpu_sharded.py [--strategies fsdp,deepspeed] [--rounds 6] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys

import torch
from _report import emit
from bench_gpu import GPT, TINY, Block, flops_per_token, tokens_per_second

RATIO_GOAL, MFU_GOAL = 0.98, 0.40
ONE_BILLION = {"layers": 24, "heads": 16, "d": 2048, "vocab": 50304, "seq": 1024}


def _hand_fsdp(model: torch.nn.Module, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = model.to(device)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, optimizer


def _ds_config(batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False}


def _hand_deepspeed(model: torch.nn.Module, device: torch.device, batch: int):
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(batch))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return step, engine, optimizer


def _torchrig(strategy: str, model: torch.nn.Module, device: torch.device, batch: int):
    from torchrig import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    options = {"fsdp_plugin": FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                                             transformer_layer_cls_to_wrap=[Block.__name__])} \
        if strategy == "fsdp" else {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=_ds_config(batch))}
    accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu", **options)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        accelerator.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, optimizer


def _local_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def local_state_bytes(model: torch.nn.Module, optimizer: object) -> int:
    """Bytes of parameters and optimizer state this rank holds between steps (shards count
    locally; gradients are set to None after each step, on both sides of the comparison)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(_local_bytes(p) for p in model.parameters()) + sum(
        _local_bytes(v) for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def replicated_state_bytes(model: torch.nn.Module) -> int:
    """What DDP holds on every rank between steps: fp32 parameters and AdamW's two moments."""
    return sum(p.numel() for p in model.parameters()) * 4 * 3


def task(ctx, strategy: str, config: dict, batch: int, rounds: int, steps: int, use_cuda: bool,
         rig_first: bool = False, copies: int = 1, control: bool = False) -> dict:
    """One trial on one rank: ``copies`` hand-written and ``copies`` torchrig copies of one model,
    built alternately (starting with torchrig's if ``rig_first``), trained on the same tokens in
    interleaved blocks (the order of the copies reversed every round). ``control`` builds both
    sides hand-written: an A/A run that measures the noise floor of the comparison itself."""
    from torchrig.testing.contracts import rank_environment

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
        device = torch.device("cuda", ctx.rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        torch.manual_seed(0)
        base = GPT(**config)
        seq, vocab = base.shape[2], base.tok.num_embeddings
        generator = torch.Generator().manual_seed(ctx.rank)
        tokens = [(torch.randint(0, vocab, (batch, seq), generator=generator).to(device),
                   torch.randint(0, vocab, (batch, seq), generator=generator).to(device)) for _ in range(2)]

        def build(side: str, model: torch.nn.Module) -> tuple:
            if side == "rig" and not control:
                return _torchrig(strategy, model, device, batch)
            return _hand_fsdp(model, device) if strategy == "fsdp" else _hand_deepspeed(model, device, batch)

        sides = ["rig", "hand"] if rig_first else ["hand", "rig"]
        built = [(side, build(side, copy.deepcopy(base))) for _ in range(copies) for side in sides]
        rig_model, rig_optimizer = next(b[1:] for side, b in built if side == "rig")  # measured after training
        flops = flops_per_token(base)
        replicated = replicated_state_bytes(base)
        steppers = [(side, b[0]) for side, b in built]
        del base, built

        for _, step_fn in steppers:  # warm up
            tokens_per_second(step_fn, tokens, steps)
        rates: dict[str, list[float]] = {"hand": [], "rig": []}  # per round: the mean over a side's copies
        for index in range(rounds):
            this_round: dict[str, list[float]] = {"hand": [], "rig": []}
            for side, step_fn in (steppers if index % 2 == 0 else steppers[::-1]):
                this_round[side].append(tokens_per_second(step_fn, tokens, steps))
            for side, values in this_round.items():
                rates[side].append(statistics.fmean(values))
        result = {"hand": statistics.median(rates["hand"]), "rig": statistics.median(rates["rig"]),
                  "ratio": statistics.median(r / h for r, h in zip(rates["rig"], rates["hand"])), "flops": flops,
                  "replicated_bytes": replicated,
                  "local_bytes": local_state_bytes(rig_model, rig_optimizer) if strategy == "fsdp" else None}
        del steppers, rig_model, rig_optimizer
        gc.collect()
        if use_cuda:
            torch.cuda.empty_cache()
        return result


def measure(strategy: str, config: dict, batch: int, rounds: int, steps: int, use_cuda: bool, world: int,
            trials: int = 2, copies: int = 1, control: bool = False) -> list[dict]:
    """Per rank: tokens/s of both sides and their ratio over ``trials`` independent trials, each in
    fresh worker processes, the side built first alternating between trials.

    On CPU, where a copy lands in memory moves its speed by several percent for as long as it
    lives, whichever side it is: A/A runs (hand-written on both sides) with one or two copies per
    side came out 0.96-1.04, the copy built first often fastest. So each trial builds ``copies``
    copies of each side, alternately, and a round's rate for a side is the mean over its copies:
    with 8 copies per side the A/A control came out 0.993 and 1.004 in its two trials. ``ratio`` is
    the geometric mean of the trials' median per-round ratios and ``trials`` every trial's ratio
    (their spread is the run's own measure of noise). One copy per side on the GPU: the 1B model
    twice is what fits."""
    from torchrig.testing.pool import WorkerPool

    env = {"DS_ACCELERATOR": "cpu"} if not use_cuda else {}
    runs = []
    for trial in range(trials):
        with WorkerPool(world_size=world, backend="nccl" if use_cuda else "gloo", env=env,
                        collective_timeout=600) as pool:
            runs.append(pool.run(task, strategy, config, batch, rounds, steps, use_cuda, trial % 2 == 1, copies,
                                 control, timeout=3600))
    combined = []
    for per_trial in zip(*runs):
        logs = [math.log(r["ratio"]) for r in per_trial]
        combined.append({**per_trial[0], "hand": statistics.fmean(r["hand"] for r in per_trial),
                         "rig": statistics.fmean(r["rig"] for r in per_trial),
                         "ratio": math.exp(statistics.fmean(logs)),
                         "trials": [r["ratio"] for r in per_trial]})
    return combined


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="fsdp,deepspeed")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps")
    args = parser.parse_args()
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    use_cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not use_cuda and not args.cpu_smoke:
        print("B8 skipped: no CUDA GPU on this machine")
        for strategy in strategies:
            emit("B8", f"~1B GPT, {strategy} plugin ÷ hand-written tokens/s; MFU", "—",
                 f"≥ {RATIO_GOAL}, MFU ≥ {MFU_GOAL:.0%}", None)
        return 0
    config, batch = (TINY, 2) if args.cpu_smoke else (ONE_BILLION, args.batch)
    if args.cpu_smoke or args.quick:
        args.rounds, args.steps = 2, 2
    world = torch.cuda.device_count() if use_cuda else 2
    all_ok = True
    for strategy in strategies:
        results = measure(strategy, config, batch, args.rounds, args.steps, use_cuda, world)
        ratio = min(r["ratio"] for r in results)
        rate = statistics.median(r["rig"] for r in results)
        mfu = rate * results[0]["flops"] / (args.peak_tflops * 1e12)
        print(f"{strategy}: {world} rank(s); torchrig {rate:,.0f} tokens/s per rank, hand-written "
              f"{statistics.median(r['hand'] for r in results):,.0f}; ratio (worst rank) {ratio:.3f}, by trial "
              f"{'; '.join('/'.join(f'{t:.3f}' for t in r['trials']) for r in results)}; "
              f"MFU = {rate:,.0f} × {results[0]['flops']:.3e} / {args.peak_tflops:.0f}e12 = {mfu:.1%}")
        if args.cpu_smoke:
            continue
        ok = ratio >= RATIO_GOAL and mfu >= MFU_GOAL
        all_ok = all_ok and ok
        emit("B8", f"~1B GPT, {strategy} plugin ÷ hand-written tokens/s ({world} GPU); MFU",
             f"{ratio:.3f}, MFU {mfu:.0%}", f"≥ {RATIO_GOAL}, MFU ≥ {MFU_GOAL:.0%}", ok)
    if args.cpu_smoke:
        print("B8 CPU smoke run finished (not a measurement)")
        return 0
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
