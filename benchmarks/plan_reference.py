"""The roofline of ``torchrig plan`` (:mod:`torchrig.estimate.step_time`) against torchtitan's published
Llama-3.1 runs — predicted vs published tokens/s per GPU and MFU, the table in docs/plan.md
("Published reference runs"; tests/estimate/test_step_time.py checks the two agree).

The inputs here are *analytic*, not recorded: per rank and optimizer step,

* matmul FLOPs 6·N·tokens over the N non-embedding parameters (forward 2·N, backward 4·N), plus
  activation-checkpoint recompute (torchtitan's selective "op" policy saves every other ``mm`` output,
  so half the forward linears run again: +1·N; full AC runs the whole forward again: +2·N and the
  attention forward), divided by the TP degree;
* attention 12·L·d·seq per token (forward 4, backward 8; full, not halved for causality — what
  ``FlopCounterMode`` counts), in bf16 (flash attention);
* matmuls taken as compute-bound (no elementwise, norm, rotary or optimizer traffic: those are
  memory-bound operators the engine's recorded step will add);
* FSDP2 over ``dp_shard``: one unit per block plus the root; per step each unit all-gathers its
  bf16 shard twice (forward, and again for backward after resharding) and reduce-scatters fp32
  gradients once (torchtitan's defaults ``mixed_precision_param=bfloat16``,
  ``mixed_precision_reduce=float32``): 2× the parameters in bf16 and 1× in fp32;
* TP with sequence parallel over ``tp``: per block, forward 2 all-gathers + 2 reduce-scatters of the
  [local batch, seq, d] bf16 activations, the same in backward, and again in a full-AC recompute;
* Float8 runs: the blocks' linears in fp8 (torchtitan converts ``nn.Linear`` in the blocks; the
  output head stays bf16), attention and all-gathers in bf16.

``torchrig plan``'s engine replaces these analytic inputs with the operators and collectives it
records from the real prepared model (torch's fake process group); this script is the calibration of
the roofline itself against public numbers.

    python benchmarks/plan_reference.py          # prints the two markdown tables
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torchrig.estimate.costs import CollectiveRecord, OpCost, ring_wire_bytes
from torchrig.estimate.hardware import gpu_spec, interconnect
from torchrig.estimate.step_time import StepTimeEstimate, axes_spanning_nodes, estimate_step_time

#: Where each published number comes from: a short tag → (file @ commit, URL at that commit).
SOURCES = {
    "T1": ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e (runs: end of 2024, torchtitan "
           "9dec370, torch 1963fc8; first published as docs/performance.md @ d4c86e3)",
           "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
           "llama3_h100_202412_torchtitan.md"),
    "T2": ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ 820504e (June 2025)",
           "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
           "asyncTP_llama3_h100_2025-06_torchtitan.md"),
    "T3": ("pytorch/torchtitan docs/performance.md @ 1ea476e (April 2024; unchanged through 4d88a8a)",
           "https://github.com/pytorch/torchtitan/blob/1ea476e9f24be439eda358aa864f45c1c37a8a88/docs/performance.md"),
}
TORCHTITAN_DEC_2024, TORCHTITAN_ASYNC_TP, TORCHTITAN_APR_2024 = "T1", "T2", "T3"


@dataclass(frozen=True)
class Llama:
    """A Llama-3 shape: enough to count its parameters and FLOPs."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256

    @property
    def block_params(self) -> int:
        kv_dim = self.dim // self.heads * self.kv_heads
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        return attention + 3 * self.dim * self.ffn + 2 * self.dim  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim

    @property
    def params(self) -> int:
        """All parameters: blocks, the embedding, the final norm and the untied output head."""
        return self.layers * self.block_params + 2 * self.embedding_params + self.dim

    @property
    def linear_params(self) -> int:
        """Parameters that take part in matmuls: all but the embedding (torchtitan's count)."""
        return self.params - self.embedding_params

    def flops_per_token(self, seq: int) -> float:
        """torchtitan's model FLOPs per token: 6·(N - embedding) + 12·L·d·seq."""
        return 6.0 * self.linear_params + 12.0 * self.layers * self.dim * seq


LLAMA_8B = Llama("Llama-3.1-8B", dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336)
LLAMA_70B = Llama("Llama-3.1-70B", dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672)


@dataclass(frozen=True)
class ReferenceRun:
    """One published run: its configuration and its numbers."""

    label: str
    model: Llama
    gpu: str
    gpus: int
    dp_shard: int
    tp: int
    local_batch: int
    seq: int
    ac: str  # "selective-op", "selective-layer", "full"
    techniques: str
    published_tps: float
    published_memory_gib: float | None
    published_mfu: float | None
    source: str
    network: str
    float8: bool = False

    @property
    def compiled(self) -> bool:
        return "torch.compile" in self.techniques


RUNS = (
    ReferenceRun("8B FSDP", LLAMA_8B, "h100-sxm", 8, 8, 1, 2, 8192, "selective-op", "bf16", 5762, 82.4, None,
                 TORCHTITAN_DEC_2024, "roce-400"),
    ReferenceRun("8B FSDP+compile", LLAMA_8B, "h100-sxm", 8, 8, 1, 2, 8192, "selective-op", "bf16, torch.compile",
                 6667, 77.0, None, TORCHTITAN_DEC_2024, "roce-400"),
    ReferenceRun("8B FSDP+compile+Float8", LLAMA_8B, "h100-sxm", 8, 8, 1, 2, 8192, "selective-op",
                 "Float8 linears, torch.compile", 8532, 76.8, None, TORCHTITAN_DEC_2024, "roce-400", float8=True),
    ReferenceRun("8B FSDP, 128 GPUs", LLAMA_8B, "h100-sxm", 128, 128, 1, 2, 8192, "selective-op", "bf16", 5605, 67.0,
                 None, TORCHTITAN_DEC_2024, "roce-400"),
    ReferenceRun("8B FSDP+compile+Float8, 128 GPUs", LLAMA_8B, "h100-sxm", 128, 128, 1, 2, 8192, "selective-op",
                 "Float8 linears, torch.compile", 8380, 61.8, None, TORCHTITAN_DEC_2024, "roce-400", float8=True),
    ReferenceRun("70B FSDP 32 × TP 8, Float8", LLAMA_70B, "h100-sxm", 256, 32, 8, 16, 8192, "full",
                 "Float8 linears, torch.compile", 829, 71.9, None, TORCHTITAN_DEC_2024, "roce-400", float8=True),
    ReferenceRun("70B FSDP 32 × TP 8, bf16", LLAMA_70B, "h100-sxm", 256, 32, 8, 16, 8192, "full",
                 "bf16, torch.compile", 597.3, None, None, TORCHTITAN_ASYNC_TP, "roce-400"),
    ReferenceRun("Llama 3 8B FSDP, 64 A100", LLAMA_8B, "a100-80gb", 64, 64, 1, 1, 8192, "selective-op", "bf16", 2973, None,
                 0.582, TORCHTITAN_APR_2024, "ib-hdr-200"),
    ReferenceRun("Llama 3 70B FSDP, 64 A100", LLAMA_70B, "a100-80gb", 64, 64, 1, 1, 8192, "full", "bf16", 331, None, 0.517,
                 TORCHTITAN_APR_2024, "ib-hdr-200"),
)

BF16, FP32 = 2, 4


def analytic_ops(run: ReferenceRun) -> list[OpCost]:
    """This rank's matmul FLOPs for one step (module docstring)."""
    model = run.model
    tokens = run.local_batch * run.seq  # the tokens of this rank's TP group
    recompute = {"selective-op": 1.0, "selective-layer": 1.0, "full": 2.0}[run.ac]
    linear_per_token = (6.0 + recompute) * model.linear_params / run.tp
    head_share = model.embedding_params / model.linear_params  # the untied output head
    attention_per_token = (12.0 + (4.0 if run.ac == "full" else 0.0)) * model.layers * model.dim * run.seq / run.tp
    block_dtype = "float8_e4m3fn" if run.float8 else "bfloat16"
    return [
        OpCost("block linears", flops=int(linear_per_token * (1 - head_share) * tokens), bytes=0, dtype=block_dtype,
               matmul=True),
        OpCost("output head", flops=int(linear_per_token * head_share * tokens), bytes=0, dtype="bfloat16",
               matmul=True),
        OpCost("attention", flops=int(attention_per_token * tokens), bytes=0, dtype="bfloat16", matmul=True),
    ]


def analytic_collectives(run: ReferenceRun) -> list[CollectiveRecord]:
    """FSDP's parameter and gradient traffic over dp_shard and TP's activation traffic over tp."""
    model, records = run.model, []
    units = model.layers + 1
    unit_params = model.params / run.tp / units
    for phase in ("forward", "backward"):
        for _ in range(units):
            payload = int(unit_params * BF16)
            records.append(CollectiveRecord("all_gather", "dp_shard", run.dp_shard, payload,
                                            ring_wire_bytes("all_gather", payload, run.dp_shard), phase))
    for _ in range(units):
        payload = int(unit_params * FP32)
        records.append(CollectiveRecord("reduce_scatter", "dp_shard", run.dp_shard, payload,
                                        ring_wire_bytes("reduce_scatter", payload, run.dp_shard), "backward"))
    if run.tp > 1:
        activation = run.local_batch * run.seq * model.dim * BF16
        passes = (("forward", 1), ("backward", 2 if run.ac == "full" else 1))  # backward + the recomputed forward
        for phase, repeats in passes:
            for kind in ("all_gather", "reduce_scatter"):
                wire = ring_wire_bytes(kind, activation, run.tp)
                records += [CollectiveRecord(kind, "tp", run.tp, activation, wire, phase)
                            for _ in range(2 * model.layers * repeats)]
    return records


def eager_elementwise_bytes_per_token(model: Llama) -> float:
    """A rough count of the HBM bytes one token's uncompiled elementwise operators move in one forward, per
    the eager torchtitan Llama: each op reads its inputs and writes its output, bf16 activations (2 B)
    upcast to fp32 (4 B) inside RMSNorm and rotary. Per block: two RMSNorms ~36·d B each (upcast, square,
    mean, scale, cast back, weight), rotary ~20 B per element of q and k, SwiGLU ~10 B per FFN element
    (silu, multiply), two residual adds 6·d B each. Not recorded: the order of magnitude the calibration
    discussion in docs/plan.md needs, which the engine's recorded operators replace."""
    kv_dim = model.dim // model.heads * model.kv_heads
    per_block = 2 * 36 * model.dim + 20 * (model.dim + kv_dim) + 10 * model.ffn + 2 * 6 * model.dim
    return float(model.layers * per_block)


def rough_elementwise_op(run: ReferenceRun) -> OpCost:
    """The eager elementwise traffic of one rank's step: forward, backward (~2 forwards) and the recompute
    (both AC modes recompute every elementwise op: torchtitan's op policy saves only matmul and attention
    outputs), ÷ TP (sequence parallel shards norms and residuals, TP shards heads and FFN)."""
    tokens = run.local_batch * run.seq
    passes = 4  # forward + backward (2) + recompute
    return OpCost("elementwise (rough, eager)", flops=0,
                  bytes=int(passes * eager_elementwise_bytes_per_token(run.model) * tokens / run.tp),
                  dtype="bfloat16", matmul=False)


def predict(run: ReferenceRun, with_elementwise: bool = False) -> StepTimeEstimate:
    """The roofline of one rank's step of ``run``; ``with_elementwise`` adds :func:`rough_elementwise_op`."""
    placement = axes_spanning_nodes((run.dp_shard, run.tp), ("dp_shard", "tp"), gpus_per_node=8)
    tokens_per_gpu = run.local_batch * run.seq / run.tp
    ops = analytic_ops(run) + ([rough_elementwise_op(run)] if with_elementwise else [])
    return estimate_step_time(ops=ops, collectives=analytic_collectives(run), gpu=gpu_spec(run.gpu),
                              interconnect=interconnect(run.network), axes_across_nodes=placement, precision="bf16",
                              gpus_per_node=8, tokens_per_step=tokens_per_gpu,
                              model_flops_per_step=run.model.flops_per_token(run.seq) * tokens_per_gpu)


def derived_mfu(run: ReferenceRun) -> float:
    """The published tokens/s per GPU × torchtitan's FLOPs per token ÷ the bf16 dense peak."""
    return run.published_tps * run.model.flops_per_token(run.seq) / gpu_spec(run.gpu).peak_flops_for("bf16")


def published_table() -> str:
    """The published runs, their configuration and where each number comes from (docs/plan.md)."""
    lines = ["| run | model | GPUs | layout | local batch × seq | AC | techniques | tokens/s/GPU | memory (GiB) "
             "| MFU | source |", "|---|---|---|---|---|---|---|---:|---:|---:|---|"]
    for run in RUNS:
        layout = f"FSDP {run.dp_shard}" + (f" × TP {run.tp}" if run.tp > 1 else "")
        memory = "—" if run.published_memory_gib is None else f"{run.published_memory_gib:g}"
        mfu = "—" if run.published_mfu is None else f"{run.published_mfu:.1%}"
        lines.append(f"| {run.label} | {run.model.name} | {run.gpus} × {run.gpu} | {layout} | {run.local_batch} × "
                     f"{run.seq} | {run.ac} | {run.techniques} | {run.published_tps:,g} | {memory} | {mfu} | "
                     f"{run.source} |")
    lines.append("")
    lines += [f"- {tag}: {text}, <{url}>" for tag, (text, url) in SOURCES.items()]
    return "\n".join(lines)


def comparison_table() -> str:
    """Predicted vs published tokens/s per GPU and MFU (docs/plan.md); for the uncompiled runs also with
    the rough eager elementwise traffic (:func:`rough_elementwise_op`) added."""
    lines = ["| run | GPUs (kind) | layout | published tokens/s/GPU | predicted tokens/s/GPU (÷ published) "
             "| + rough elementwise (÷ published) | MFU published (derived) | MFU predicted (matmuls only) "
             "| step: matmul / exposed comm (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in RUNS:
        estimate = predict(run)
        layout = f"FSDP {run.dp_shard}" + (f" × TP {run.tp}" if run.tp > 1 else "") + f"; {run.techniques}"
        if run.float8:  # bf16 and fp8 tensor cores both run: no single peak to measure against (as torchtitan says)
            mfu, predicted_mfu = "—", "—"
        else:
            derived = f"({derived_mfu(run):.1%})"
            mfu = f"{run.published_mfu:.1%} {derived}" if run.published_mfu else derived
            predicted_mfu = f"{estimate.mfu:.1%}"
        if run.compiled:  # compile fuses elementwise ops: the eager count does not apply
            with_elementwise = "—"
        else:
            tps = predict(run, with_elementwise=True).tokens_per_s
            with_elementwise = f"{tps:,.0f} ({tps / run.published_tps:.2f})"
        lines.append(f"| {run.label} | {run.gpus} ({run.gpu}) | {layout} | {run.published_tps:,.0f} | "
                     f"{estimate.tokens_per_s:,.0f} ({estimate.tokens_per_s / run.published_tps:.2f}) | "
                     f"{with_elementwise} | {mfu} | {predicted_mfu} | "
                     f"{estimate.compute_s:.2f} / {estimate.exposed_comm_s:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assumptions", action="store_true", help="also print the roofline's stated assumptions")
    args = parser.parse_args()
    print(published_table())
    print()
    print(comparison_table())
    if args.assumptions:
        for line in predict(RUNS[0]).describe_assumptions():
            print(f"- {line}")


if __name__ == "__main__":
    main()
