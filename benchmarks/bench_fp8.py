"""B16 and B17 (GPU): fp8 training of a ~1B Llama-style model through torchrig.

B16  torchrig fp8 + compile ÷ torchrig bf16 + compile, tokens/s on one GPU. Goal ≥ 1.2× on an H100
     (torchtitan reports +28% for Llama-3.1-8B with Float8 tensorwise).
B17  torchrig fp8 + compile ÷ a hand-written torchao fp8 loop (``convert_to_float8_training`` with the
     same layer filter, bf16 autocast, ``torch.compile``, fused AdamW). Goal ≥ 0.98.

Model: 16 layers, d=2048, 16 heads, SwiGLU FFN 5632, RMSNorm, vocab 32000, untied head, sequence
2048 (~0.95B parameters; no rotary embedding — it has no matmul and leaves the fp8 share alike).
Each runner trains its own copy on the same random tokens; blocks of steps alternate between the
runners (order reversed every block), each timed between ``cuda.synchronize()`` calls; medians
of blocks. MFU via :mod:`torchrig.tracking.throughput`: tokens/s × ``transformer_flops_per_token`` (6·N +
12·L·d·T) ÷ the GPU's dense peak from ``PEAK_FLOPS`` — against the bf16 peak for every runner (as
torchtitan reports fp8 runs, so the numbers compare) and, for fp8, also against the fp8 peak.

Without a CUDA GPU of compute capability ≥ 8.9 both rows are reported as skipped. ``--cpu-smoke``
runs two steps of a tiny configuration of the three runners on the CPU (fp8 emulated, no
compile) to check the script itself.

    python benchmarks/bench_fp8.py [--blocks 6] [--steps 5] [--batch 4] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time

import torch
from _report import emit
from torch import nn
from torchrig.tracking.throughput import device_peak_flops, non_embedding_params, transformer_flops_per_token

SPEEDUP_GOAL, RATIO_GOAL = 1.2, 0.98
LLAMA_1B = {"layers": 16, "d": 2048, "heads": 16, "ffn": 5632, "vocab": 32000, "seq": 2048}
#: ``--cpu-smoke``: every Linear a multiple of 16, a few hundred thousand parameters.
TINY = {"layers": 2, "d": 64, "heads": 4, "ffn": 128, "vocab": 256, "seq": 32}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, ffn: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        self.n_layers, self.dim, self.seq = layers, d, seq

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.output(self.norm(x))
        return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def with_torchrig(model: nn.Module, precision: str, device: torch.device, compile_model: bool):
    from torchrig import Accelerator
    from torchrig_fp8.options import AORecipeKwargs

    handlers = [AORecipeKwargs(emulate=device.type == "cpu")] if precision == "fp8" else []
    accelerator = Accelerator(mixed_precision=precision, cpu=device.type == "cpu", kwargs_handlers=handlers,
                              dynamo_backend="inductor" if compile_model else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hand_written_fp8(model: nn.Module, device: torch.device, compile_model: bool):
    """What a user writes with torchao alone: the same filter as torchrig's default (feature counts
    multiples of 16), bf16 autocast for the rest."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=device.type == "cpu")
    model = model.to(device)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: (
        module.in_features % 16 == 0 and module.out_features % 16 == 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    run_model = torch.compile(model) if compile_model else model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run_model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def tokens_per_second(step_fn, tokens: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> float:
    cuda = tokens[0][0].is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step_fn(*tokens[i % len(tokens)])
    if cuda:
        torch.cuda.synchronize()
    return tokens[0][0].numel() * steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 blocks of 2 steps")
    args = parser.parse_args()
    speedup_what = "~1B Llama fp8 + compile ÷ bf16 + compile tokens/s, torchrig (1 GPU); MFU"
    ratio_what = "~1B Llama fp8 + compile: torchrig ÷ hand-written torchao tokens/s (1 GPU)"
    capable = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)
    if args.cpu_smoke:
        device, config, batch, compile_model = torch.device("cpu"), TINY, 2, False
        args.blocks, args.steps = 1, 2
    elif not capable:
        reason = "no CUDA GPU" if not torch.cuda.is_available() else (
            f"{torch.cuda.get_device_name(0)} has compute capability {torch.cuda.get_device_capability(0)} < 8.9")
        print(f"B16/B17 skipped: {reason} (fp8 matmuls need an Ada/Hopper GPU)")
        emit("B16", speedup_what, "—", f"≥ {SPEEDUP_GOAL}×", None)
        emit("B17", ratio_what, "—", f"≥ {RATIO_GOAL}", None)
        return 0
    else:
        device, config, batch, compile_model = torch.device("cuda"), LLAMA_1B, args.batch, True
    if args.quick:
        args.blocks, args.steps = 2, 2

    torch.manual_seed(0)
    base = Llama(**config)
    tokens = [(torch.randint(0, config["vocab"], (batch, config["seq"]), device=device),
               torch.randint(0, config["vocab"], (batch, config["seq"]), device=device)) for _ in range(2)]
    runners = {"torchrig bf16": with_torchrig(copy.deepcopy(base), "bf16", device, compile_model),
               "torchrig fp8": with_torchrig(copy.deepcopy(base), "fp8", device, compile_model),
               "hand-written fp8": hand_written_fp8(copy.deepcopy(base), device, compile_model)}
    for step_fn in runners.values():  # compile and warm up
        tokens_per_second(step_fn, tokens, 2)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(args.blocks):
        for name in (list(runners) if index % 2 == 0 else list(reversed(runners))):
            rates[name].append(tokens_per_second(runners[name], tokens, args.steps))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    speedup = statistics.median(a / b for a, b in zip(rates["torchrig fp8"], rates["torchrig bf16"]))
    ratio = statistics.median(a / b for a, b in zip(rates["torchrig fp8"], rates["hand-written fp8"]))

    flops = transformer_flops_per_token(non_embedding_params(base), base.n_layers, base.dim, base.seq)
    peak_bf16, peak_fp8 = device_peak_flops(device, "bf16"), device_peak_flops(device, "fp8")
    print(f"{sum(p.numel() for p in base.parameters()) / 1e9:.2f}B parameters, {batch}×{base.seq} tokens per step; "
          f"FLOPs/token = 6·N + 12·L·d·T = {flops:.3e}")
    for name, value in medians.items():
        mfu = f", MFU {value * flops / peak_bf16:.1%} of the bf16 peak" if peak_bf16 else ""
        if peak_fp8 and "fp8" in name:
            mfu += f" ({value * flops / peak_fp8:.1%} of the fp8 peak)"
        print(f"{name:<18} {value:>12,.0f} tokens/s{mfu}")
    if args.cpu_smoke:
        print(f"B16/B17 CPU smoke run finished (fp8 ÷ bf16 {speedup:.2f}, torchrig ÷ hand-written {ratio:.2f}; "
              "not a measurement)")
        return 0
    mfu_fp8 = f", MFU {medians['torchrig fp8'] * flops / peak_bf16:.0%}" if peak_bf16 else ""
    speedup_ok, ratio_ok = speedup >= SPEEDUP_GOAL, ratio >= RATIO_GOAL
    print(f"B16 fp8 ÷ bf16 = {speedup:.3f} (goal ≥ {SPEEDUP_GOAL}): {'PASS' if speedup_ok else 'FAIL'}")
    print(f"B17 torchrig ÷ hand-written fp8 = {ratio:.3f} (goal ≥ {RATIO_GOAL}): {'PASS' if ratio_ok else 'FAIL'}")
    emit("B16", speedup_what, f"{speedup:.3f}×, {medians['torchrig fp8'] / 1e3:,.1f}K tok/s{mfu_fp8}",
         f"≥ {SPEEDUP_GOAL}×", speedup_ok)
    emit("B17", ratio_what, f"{ratio:.3f}", f"≥ {RATIO_GOAL}", ratio_ok)
    return 0 if speedup_ok and ratio_ok else 1


if __name__ == "__main__":
    sys.exit(main())
