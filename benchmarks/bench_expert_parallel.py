"""B19: a mixture-of-experts step under expert parallelism through torchrig ÷ the same written by hand with
torch's APIs (4 CPU ranks, ep 2 borrowed from dp_shard 4, fp32), tokens/s ≥ 0.98.

Model: a Llama-style transformer (bench_mesh's attention, RMSNorm) whose MLPs are top-2 mixtures of 8
experts held as 3-D weights (:class:`torchrig.testing.models.GroupedExperts`, grouped GEMMs), with a
load-balancing loss; it declares ``_ep_plan``.

Hand-written side, what a torchtitan-style script does with torch's APIs: ``init_device_mesh`` over
``dp_shard``, ``DeviceMesh._unflatten`` into ``(efsdp, ep)``, each experts module's weights
``distribute_tensor(..., Shard(0))`` over ``ep``, its forward replaced by a dispatch written here (counts
exchanged with ``all_to_all_single``, rows there and back with the functional
``all_to_all_single_autograd``, the experts' local gradients scaled by 1/ep with tensor hooks),
``fully_shard`` of the experts over ``efsdp``, of each block and the root over ``dp_shard``, AdamW.
torchrig side: ``Accelerator(strategy="fsdp", parallelism_config={"dp_shard_size": 4, "ep_size": 2})``
and the model's own ``_ep_plan``. Same tokens per rank. Procedure: B13's (bench_mesh.measure's: fresh
processes per trial, ``--copies`` copies of each side built ABBA, interleaved rounds, the geometric mean
over trials of the median per-round ratio of the worst rank, a bootstrap interval).

    python benchmarks/bench_expert_parallel.py [--trials 2] [--copies 2] [--rounds 6] [--steps 2] [--loaded]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from _report import emit
from _stats import bootstrap_ci, combine_trials, interleaved_rates
from bench_gpu import tokens_per_second
from bench_mesh import Attention
from torch import nn

GOAL = 0.98
CONFIG = {"layers": 2, "dim": 64, "heads": 4, "hidden": 128, "experts": 8, "top_k": 2, "vocab": 512, "seq": 64}
DP_SHARD, EP = 4, 2


class Router(nn.Module):
    """Top-k softmax routing and the Switch load-balancing loss (``aux_loss``)."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.gate = top_k, nn.Linear(dim, experts, bias=False)
        self.aux_loss = torch.zeros(())

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        experts = probs.shape[-1]
        routed = nn.functional.one_hot(index, experts).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux_loss = experts * (routed * probs.mean(dim=0)).sum()
        return index, weights / weights.sum(dim=-1, keepdim=True)


class MoeMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        from torchrig.testing.models import GroupedExperts

        super().__init__()
        self.router, self.experts = Router(dim, experts, top_k), GroupedExperts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        index, weights = self.router(flat)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.moe = Attention(dim, heads), MoeMLP(dim, hidden, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoeLlama(nn.Module):
    _ep_plan = {"blocks.*.moe.experts": "ep_dispatch_experts"}

    def __init__(self, layers: int, dim: int, heads: int, hidden: int, experts: int, top_k: int, vocab: int,
                 seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, experts, top_k) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        return loss + 0.01 * sum(block.moe.router.aux_loss for block in self.blocks)


def _stepper(model: nn.Module, optimizer: torch.optim.Optimizer, backward=None):
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        (backward or torch.Tensor.backward)(model(x, y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _hand_expert_parallel(experts: nn.Module, ep_mesh) -> None:
    """Hand-written EP on one experts module: weights Shard(0) over ep, the forward a dispatch to the
    experts' ranks and back."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.tensor import Shard, distribute_tensor

    ep, group = ep_mesh.size(), ep_mesh.get_group()
    total = experts.num_experts
    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)],
                                                                        src_data_rank=None)))
    experts.num_experts = local = total // ep
    run_local = experts.forward

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        slots = top_k_index.reshape(-1)
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=total)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=group)
        out_rows = counts.view(ep, local).sum(1).tolist()
        in_rows = incoming.view(ep, local).sum(1).tolist()
        rows = all_to_all_single_autograd(hidden[order // top_k_index.shape[1]], in_rows, out_rows, group)
        ids = torch.arange(local).repeat(ep).repeat_interleave(incoming, output_size=rows.shape[0])
        weights = {name: param for name, param in experts._parameters.items()}
        for name, param in weights.items():  # this rank's experts; their gradient a 1/ep share
            local_weight = param.to_local()
            local_weight.register_hook(lambda grad: grad / ep)
            experts._parameters[name] = local_weight
        try:
            done = run_local(rows, ids.unsqueeze(1), rows.new_ones(rows.shape[0], 1))
        finally:
            experts._parameters.update(weights)
        back = all_to_all_single_autograd(done, out_rows, in_rows, group)
        unsorted = torch.empty_like(back).index_copy(0, order, back)
        return (unsorted.view(*top_k_weights.shape, -1) * top_k_weights.unsqueeze(-1)).sum(1)

    experts.forward = forward


def hand_written(model: nn.Module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (DP_SHARD,), mesh_dim_names=("dp_shard",))
    split = mesh._unflatten("dp_shard", (DP_SHARD // EP, EP), ("efsdp", "ep"))
    for block in model.blocks:
        _hand_expert_parallel(block.moe.experts, split["ep"])
        fully_shard(block.moe.experts, mesh=split["efsdp"])
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def with_torchrig(model: nn.Module):
    from torchrig import Accelerator, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"dp_shard_size": DP_SHARD, "ep_size": EP},
                              fsdp_plugin=FullyShardedDataParallelPlugin(
                                  auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=["Block"]))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return _stepper(model, optimizer, accelerator.backward)


def task(ctx, batch: int, rounds: int, steps: int, rig_first: bool, copies: int, control: bool) -> dict:
    """One trial on one rank: per-round rates of both sides (bench_mesh.task's procedure)."""
    from torchrig.testing.contracts import rank_environment

    with rank_environment(ctx.rank, ctx.world_size):
        os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
        torch.manual_seed(0)
        base = MoeLlama(**CONFIG)
        generator = torch.Generator().manual_seed(ctx.rank)
        tokens = [tuple(torch.randint(0, CONFIG["vocab"], (batch, CONFIG["seq"]), generator=generator)
                        for _ in range(2)) for _ in range(2)]

        def build(side: str, model: nn.Module):
            return side, (with_torchrig if side == "rig" and not control else hand_written)(model)

        sides = ["rig", "hand"] if rig_first else ["hand", "rig"]
        order = [side for index in range(copies) for side in (sides if index % 2 == 0 else sides[::-1])]
        steppers = [build(side, copy.deepcopy(base)) for side in order]
        return interleaved_rates(steppers, rounds, lambda step: tokens_per_second(step, tokens, steps))


def measure(batch: int, rounds: int, steps: int, trials: int, copies: int, control: bool) -> list[dict]:
    from torchrig.testing.pool import WorkerPool

    runs = []
    for trial in range(trials):
        with WorkerPool(world_size=DP_SHARD, backend="gloo", collective_timeout=600) as pool:
            runs.append(pool.run(task, batch, rounds, steps, trial % 2 == 1, copies, control, timeout=3600))
    return combine_trials(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2, help="independent trials, each in fresh processes")
    parser.add_argument("--copies", type=int, default=2, help="copies of each side per trial")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per trial")
    parser.add_argument("--steps", type=int, default=2, help="training steps per block")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--control", action="store_true", help="A/A: hand-written copies on both sides")
    parser.add_argument("--loaded", action="store_true", help="mark the row as measured on a shared machine")
    args = parser.parse_args()
    print(f"B19 expert parallel (ep {EP} of dp_shard {DP_SHARD}, {CONFIG['experts']} experts top-{CONFIG['top_k']}), "
          f"4 CPU ranks (gloo), fp32, {args.trials} trials × {args.copies} copies per side × {args.rounds} rounds × "
          f"{args.steps} steps{' — A/A control' if args.control else ''}")
    results = measure(args.batch, args.rounds, args.steps, args.trials, args.copies, args.control)
    worst = min(results, key=lambda r: r["ratio"])
    low, high = bootstrap_ci(worst["ratios"])
    for rank, r in enumerate(results):
        print(f"  rank {rank}: hand-written {r['hand']:,.0f} tokens/s, torchrig {r['rig']:,.0f} tokens/s, "
              f"ratio {r['ratio']:.3f} (trials {' '.join(f'{t:.3f}' for t in r['trials'])})")
    if args.control:
        print(f"B19 A/A control ratio (worst rank) {worst['ratio']:.3f} [{low:.3f}, {high:.3f}]: no goal")
        return 0
    ok = worst["ratio"] >= GOAL
    print(f"B19 ratio (worst rank) {worst['ratio']:.3f}, 95% interval of per-round ratios [{low:.3f}, {high:.3f}] "
          f"(goal ≥ {GOAL}): {'PASS' if ok else 'FAIL'}")
    trials = " ".join(f"{t:.3f}" for t in worst["trials"])
    emit("B19", "fsdp plugin expert parallel (ep 2 × efsdp 2) ÷ hand-written EP, tokens/s (4 CPU ranks)",
         f"{worst['ratio']:.3f} [{low:.3f}, {high:.3f}] (trials {trials}){' (measured under load)' * args.loaded}",
         f"≥ {GOAL}", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
