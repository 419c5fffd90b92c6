"""B19 SAC: activation checkpointing policies side by side — activation memory and step time against no checkpointing.

One process, the fsdp strategy at world 1 (the model unsharded; the policy applied to its blocks as under FSDP2),
a Llama-style causal LM (``--layers`` pre-norm blocks of attention + MLP, width ``--width``, ``--seq`` tokens,
batch ``--batch``), AdamW. For each policy — none, full, every_k 2, selective (keep every matmul output),
selective keeping every 2nd matmul, offload (CPU: the hooks run, nothing moves), and with ``--compile`` the
memory_budget policy at 0.5 and 0 under inductor against compiled no-checkpointing — the script measures:

* saved activations: the bytes of the storages alive after the forward that were not alive before it (what
  backward will read: the activations each policy keeps; :func:`torchrig.testing.memory.live_storages`); for
  the compiled rows the bytes the compiled graph saves through autograd's saved-tensor hooks;
* step time: forward + backward + optimizer step, the median of ``--repeats`` steps taken round-robin across
  policies (one step of each per round, after a warm-up round), so machine noise hits every policy alike; the
  compiled rows one policy after another (each compiles its own forward from a reset: torch reuses a compiled
  forward for every instance of a class, and reads the budget once, when it partitions).

Ratios are to ``none`` measured in the same run. The row is met when the memory orders as predicted:
none > every_k > full, none > selective > selective every 2nd matmul > full.

    python benchmarks/bench_activation_checkpointing.py [--repeats 7] [--layers 8] [--width 256] [--seq 256]
                                                         [--batch 4] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from _report import emit
from torchrig.testing.memory import bytes_held_since, live_storages

POLICIES: dict[str, dict] = {
    "none": {},
    "full": {"activation_checkpointing": True},
    "every_k 2": {"activation_checkpointing_policy": "every_k", "activation_checkpointing_every_k": 2},
    "selective": {"activation_checkpointing_policy": "selective"},
    "selective, every 2nd matmul": {"activation_checkpointing_policy": "selective",
                                    "activation_checkpointing_matmul_every_k": 2},
    "offload (CPU: no move)": {"activation_offload": True},
}
COMPILED: dict[str, dict] = {
    "compiled none": {},
    "compiled memory_budget 0.5": {"activation_checkpointing_policy": "memory_budget",
                                   "activation_checkpointing_memory_budget": 0.5},
    "compiled memory_budget 0": {"activation_checkpointing_policy": "memory_budget",
                                 "activation_checkpointing_memory_budget": 0.0},
}


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(width), torch.nn.RMSNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.gate_up = torch.nn.Linear(width, 8 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, seq, width))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class LM(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, layers: int, width: int, vocab: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width, max(1, width // 64)) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())


class Side:
    """One policy's prepared model, optimizer and batch."""

    def __init__(self, fsdp_config: dict, args: argparse.Namespace, compiled: bool) -> None:
        from torchrig import Accelerator
        from torchrig.plugin import TorchDynamoPlugin
        from torchrig_fsdp.options import FullyShardedDataParallelPlugin

        gc.collect()
        dynamo = TorchDynamoPlugin(backend="inductor" if compiled else "no")
        self.accelerator = Accelerator(cpu=True, strategy="fsdp", dynamo_plugin=dynamo,
                                       fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_config))
        torch.manual_seed(0)
        model = LM(args.layers, args.width)
        self.model, self.optimizer = self.accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 512, (args.batch, args.seq + 1), generator=generator)
        self.batch = tokens[:, :-1], tokens[:, 1:]
        self.times: list[float] = []
        self.saved = 0
        self.compiled = compiled

    def step(self) -> float:
        """One timed training step."""
        start = time.perf_counter()
        self._finish(self.model(*self.batch))
        return time.perf_counter() - start

    def measure_saved(self) -> None:
        """One untimed step: the bytes its forward left alive for backward. A compiled step's saved tensors are
        not Python objects the storage walk finds: they are counted as autograd packs them (the compiled graph
        saves through the saved-tensor hooks; the partitioner has already chosen what to recompute)."""
        if self.compiled:
            packed = [0]

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                packed[0] += tensor.numel() * tensor.element_size()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = self.model(*self.batch)
            self.saved = packed[0]
        else:
            baseline = live_storages()
            loss = self.model(*self.batch)
            self.saved = bytes_held_since(baseline)
        self._finish(loss)

    def _finish(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def measure(policies: dict[str, dict], args: argparse.Namespace) -> dict[str, Side]:
    """Eager policies: warm-up and the memory of one step each, then ``--repeats`` steps round-robin."""
    sides = {name: Side(config, args, compiled=False) for name, config in policies.items()}
    for side in sides.values():
        side.step()
        side.measure_saved()
    for _ in range(args.repeats):
        for side in sides.values():
            side.times.append(side.step())
    return sides


def measure_compiled(policies: dict[str, dict], args: argparse.Namespace) -> dict[str, Side]:
    """Compiled policies, one after another: torch reuses a compiled forward for every instance of a class, and
    the budget is read once, when the partitioner runs, so each side starts from a reset and compiles its own."""
    sides: dict[str, Side] = {}
    for name, config in policies.items():
        torch._dynamo.reset()
        side = sides[name] = Side(config, args, compiled=True)
        side.step()
        side.measure_saved()
        side.times = [side.step() for _ in range(args.repeats)]
    return sides


def report(sides: dict[str, Side], baseline: str) -> None:
    base = sides[baseline]
    base_time = statistics.median(base.times)
    print(f"  {'policy':34s} {'saved activations':>18s} {'÷ ' + baseline:>16s} {'step (median)':>14s} {'÷ ' + baseline:>16s}")
    for name, side in sides.items():
        step = statistics.median(side.times)
        print(f"  {name:34s} {side.saved / 2**20:15.1f} MiB {side.saved / base.saved:16.2f} {step * 1e3:11.1f} ms "
              f"{step / base_time:16.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="also the memory_budget policy under inductor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"B19 SAC: {args.layers} blocks, width {args.width}, {args.seq} tokens × batch {args.batch}, one CPU "
          f"process (fsdp strategy at world 1), {args.repeats} interleaved steps per policy, torch {torch.__version__}")
    sides = measure(POLICIES, args)
    report(sides, "none")
    if args.compile:
        report(measure_compiled(COMPILED, args), "compiled none")
    saved = {name: side.saved for name, side in sides.items()}
    ok = (saved["none"] > saved["every_k 2"] > saved["full"]
          and saved["none"] > saved["selective"] > saved["selective, every 2nd matmul"] > saved["full"])
    time_of = {name: statistics.median(side.times) / statistics.median(sides["none"].times) for name, side in sides.items()}
    value = (f"mem÷none full {saved['full'] / saved['none']:.2f} sel {saved['selective'] / saved['none']:.2f}; "
             f"time full {time_of['full']:.2f} sel {time_of['selective']:.2f}")
    print(f"saved activations ordered as predicted (none > every_k > full, none > selective > every 2nd > full): "
          f"{'ok' if ok else 'MISSED'}")
    emit("B19 SAC", "activation checkpointing policies: saved activations and step time ÷ none (1 CPU process)",
         value, "memory ordered as predicted", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
