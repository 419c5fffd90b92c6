"""B7 (GPU): GPT-2-124M-style training, bf16 + torch.compile, torchrig ÷ a hand-written loop.

Both loops train their own copy of the same model (12 layers, 12 heads, d=768, vocab 50304,
sequence 1024) on the same random tokens, compiled with inductor, AdamW (fused), bf16 autocast;
blocks of steps alternate between the two, each timed between ``cuda.synchronize()`` calls.
Reported: tokens/s (median of blocks) of each, the ratio, and MFU =
``tokens/s × (6·N + 12·L·d·T) / peak`` (N parameters without embeddings' reuse counted once, L
layers, d width, T sequence; peak = 989 TFLOP/s dense bf16 for an H100 SXM, ``--peak-tflops``
to change). Goals: ratio ≥ 0.99 and ≥ 420K tokens/s on one H100.

Without a CUDA GPU the row is reported as skipped. ``--cpu-smoke`` runs two steps of a tiny
configuration of both loops on the CPU (no compile) to check the script itself.

    python benchmarks/bench_gpu.py [--blocks 10] [--steps 10] [--batch 16] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _report import emit
from torch import nn

RATIO_GOAL, TOKENS_GOAL = 0.99, 420_000


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, heads: int = 12, d: int = 768, vocab: int = 50304, seq: int = 1024) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.shape = (layers, d, seq)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def tokens_per_second(step_fn, tokens: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> float:
    """Train ``steps`` steps cycling through ``tokens``; tokens/s between device synchronisations."""
    cuda = tokens[0][0].is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step_fn(*tokens[i % len(tokens)])
    if cuda:
        torch.cuda.synchronize()
    return tokens[0][0].numel() * steps / (time.perf_counter() - start)


#: The configuration of ``--cpu-smoke`` runs (a few thousand parameters).
TINY = {"layers": 2, "heads": 2, "d": 64, "vocab": 256, "seq": 32}


def flops_per_token(model: GPT) -> float:
    layers, d, seq = model.shape
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 12 * layers * d * seq


def hand_written(model: nn.Module, device: torch.device, compile_model: bool):
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    run_model = torch.compile(model) if compile_model else model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run_model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def with_torchrig(model: nn.Module, device: torch.device, compile_model: bool):
    from torchrig import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu",
                              dynamo_backend="inductor" if compile_model else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 blocks of 3 steps")
    args = parser.parse_args()
    what = "GPT-2-124M bf16 + compile tokens/s ÷ hand-written (1 GPU); MFU"
    if args.cpu_smoke:
        device, config, batch, compile_model = torch.device("cpu"), TINY, 2, False
        args.blocks, args.steps = 1, 2
    elif not torch.cuda.is_available():
        print("B7 skipped: no CUDA GPU on this machine")
        emit("B7", what, "—", f"≥ {RATIO_GOAL}, ≥ {TOKENS_GOAL // 1000}K tokens/s", None)
        return 0
    else:
        device, config, batch, compile_model = torch.device("cuda"), {}, args.batch, True
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.quick:
        args.blocks, args.steps = 2, 3

    torch.manual_seed(0)
    base = GPT(**config)
    seq, vocab = base.shape[2], base.tok.num_embeddings
    tokens = [(torch.randint(0, vocab, (batch, seq), device=device), torch.randint(0, vocab, (batch, seq), device=device))
              for _ in range(4)]
    runners = {"hand-written": hand_written(copy.deepcopy(base), device, compile_model),
               "torchrig": with_torchrig(copy.deepcopy(base), device, compile_model)}

    def block(step_fn) -> float:
        return tokens_per_second(step_fn, tokens, args.steps)

    for step_fn in runners.values():  # compile and warm up
        block(step_fn)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(args.blocks):
        for name in (list(runners) if index % 2 == 0 else list(reversed(runners))):
            rates[name].append(block(runners[name]))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = statistics.median(a / b for a, b in zip(rates["torchrig"], rates["hand-written"]))
    mfu = medians["torchrig"] * flops_per_token(base) / (args.peak_tflops * 1e12)
    for name, value in medians.items():
        print(f"{name:<14} {value:>12,.0f} tokens/s")
    print(f"MFU = tokens/s × (6·N + 12·L·d·T) / peak = {medians['torchrig']:,.0f} × {flops_per_token(base):.3e} / "
          f"{args.peak_tflops:.0f}e12 = {mfu:.1%}")
    if args.cpu_smoke:
        print(f"B7 CPU smoke run finished (ratio {ratio:.2f}; not a measurement)")
        return 0
    ok = ratio >= RATIO_GOAL and medians["torchrig"] >= TOKENS_GOAL
    print(f"B7 torchrig ÷ hand-written = {ratio:.3f} (goal ≥ {RATIO_GOAL}), {medians['torchrig']:,.0f} tokens/s "
          f"(goal ≥ {TOKENS_GOAL:,}): {'PASS' if ok else 'FAIL'}")
    emit("B7", what, f"{ratio:.3f}, {medians['torchrig'] / 1e3:,.0f}K tok/s, MFU {mfu:.0%}",
         f"≥ {RATIO_GOAL}, ≥ {TOKENS_GOAL // 1000}K tokens/s", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
