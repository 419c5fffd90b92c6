"""Tiny models the tests of torchrig and of its plugins share, so that one name means one network.

Each one is small enough for a 2-rank gloo run on a shared CPU (widths 8-32, two to four blocks) and
deterministic: ``torch.manual_seed(s)`` then the constructor gives the same weights in every process, which is
what a distributed run is compared against. Changing a constructor changes the numbers the tests compare: add a
new model instead.

* :class:`TinyTransformer` — residual :class:`Block` s declared in ``_no_split_modules`` as Hugging Face models
  declare theirs (FSDP wrap policies, strategy tests): 6 features in, 3 classes out;
* :class:`TinyLM` — a causal language model (embedding, attention + MLP blocks, head) whose forward returns the
  loss, with the tensor-parallel plans :data:`TP_PLAN` and :data:`TP_SP_PLAN`; :func:`lm_data` its tokens;
* :class:`PipeLM` — the same blocks written for pipeline splitting (a stage is the model with the other stages'
  modules set to ``None``), trained with :func:`lm_loss`;
* :class:`CompileStack` — Linear+ReLU blocks with an optional graph break, for compilation counts;
* :class:`MoeLM` — a causal language model whose MLPs are mixtures of experts (:class:`MoE`: a top-k router, a
  load-balancing loss, :class:`GroupedExperts` with grouped GEMMs), declaring ``_ep_plan`` for expert parallelism.

Tiny Hugging Face models (transformers configs, no network) are in :mod:`torchrig.testing.hf_models`, the LoRA
workload every strategy's PEFT test trains in :mod:`torchrig.testing.peft_lora`.
"""

from __future__ import annotations

import torch

# -- a classifier made of repeated blocks ------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Pre-norm residual MLP block: the unit FSDP wraps when a model names it in ``_no_split_modules``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyTransformer(torch.nn.Module):
    """Blocks named like a Hugging Face model's, which declares them in ``_no_split_modules``; input
    ``(batch, 6)`` floats, output ``(batch, classes)`` logits."""

    _no_split_modules = ["Block"]

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# -- a causal language model and its tensor-parallel plans ------------------------------------------------------

VOCAB, DIM, HEADS, SEQ = 32, 32, 4, 8

#: :class:`TinyLM` split over a ``tp`` axis (the plan's style names: docs/parallelism.md).
TP_PLAN = {
    "embed": "embedding",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "output",
}
#: :data:`TP_PLAN` with sequence parallel: norms and residuals sharded along the sequence.
TP_SP_PLAN = {
    "embed": "embedding_sp",
    "blocks.*.norm[12]": "sequence_parallel",
    "blocks.*.attn": "prepare_input_sp",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise_sp",
    "blocks.*.mlp": "prepare_input_sp",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise_sp",
    "norm": "sequence_parallel",
    "head": "output_sp",
}


class Attention(torch.nn.Module):
    """Causal self-attention; the head count follows the projections' (local) width under tensor parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head = DIM // HEADS  # local heads under tensor parallel: -1 below
        q, k, v = (proj(x).view(batch, seq, -1, head).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class LMBlock(torch.nn.Module):
    """Pre-norm attention + MLP: the repeated unit of :class:`TinyLM` and :class:`PipeLM`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """Embedding, two :class:`LMBlock` s, a norm and a head; ``forward(tokens, labels)`` returns the loss (so it
    runs under ``loss_parallel``)."""

    _no_split_modules = ["LMBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(LMBlock() for _ in range(2))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def lm_data(samples: int, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """``samples`` random sequences of :data:`SEQ` tokens and the same shifted by one (the labels)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


PIPE_LAYERS = 4


class PipeLM(torch.nn.Module):
    """Written as torchtitan's models are for pipeline splitting: a stage is the model with the other stages'
    modules removed, so the forward skips a module that is ``None`` and iterates the layers it still has.
    Returns logits; the loss is :func:`lm_loss`."""

    _no_split_modules = ["LMBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(LMBlock() for _ in range(PIPE_LAYERS))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


# -- a stack for compilation -------------------------------------------------------------------------------------


class LinearBlock(torch.nn.Module):
    """Linear(8, 8) + ReLU; ``graph_break`` puts a dynamo graph break between them."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return torch.relu(x)


class CompileStack(torch.nn.Module):
    """Repeated :class:`LinearBlock` s and a Linear(8, 1) head: what regional compilation compiles once per
    block class; input ``(batch, 8)``."""

    def __init__(self, blocks: int = 3, graph_break: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(LinearBlock(graph_break) for _ in range(blocks))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# -- a mixture-of-experts language model ---------------------------------------------------------------------------

MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN = 4, 2, 32


def grouped_linear(tokens: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``tokens`` (grouped by expert, ``counts[e]`` rows for expert ``e``) times each expert's ``weights[e]``
    (``[experts, in, out]``): one grouped GEMM where torch has it for these shapes (``grouped_mm``: rows whose
    bytes are multiples of 16), else a loop over the experts."""
    width_in, width_out = weights.shape[-2:]
    aligned = (width_in * tokens.element_size()) % 16 == 0 and (width_out * tokens.element_size()) % 16 == 0
    if hasattr(torch.nn.functional, "grouped_mm") and aligned and tokens.shape[0] > 0:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch.nn.functional.grouped_mm(tokens, weights, offs=offsets)
    pieces = tokens.split(counts.tolist())
    return torch.cat([piece @ weights[index] for index, piece in enumerate(pieces)])


class GroupedExperts(torch.nn.Module):
    """``num_experts`` gated MLPs stored as 3-D weights (leading dimension: the expert), with transformers'
    experts contract — ``forward(hidden_states [tokens, dim], top_k_index [tokens, k] (this module's expert
    ids), top_k_weights [tokens, k])`` returns each token's weighted sum of its experts' outputs — so that
    expert parallelism (``ep_dispatch_experts``) can hand it the tokens other ranks routed to its experts."""

    def __init__(self, num_experts: int = MOE_EXPERTS, dim: int = DIM, hidden: int = MOE_HIDDEN) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = torch.nn.Parameter(torch.randn(num_experts, dim, 2 * hidden) * dim ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden ** -0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        counts = expert_ids.new_zeros(self.num_experts).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        grouped = hidden_states[order // top_k]
        gate, up = grouped_linear(grouped, self.gate_up, counts).chunk(2, dim=-1)
        out = grouped_linear(torch.nn.functional.silu(gate) * up, self.down, counts)
        out = torch.empty_like(out).index_copy(0, order, out)  # back to (token, slot) order
        return (out.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)).sum(dim=1)


class MoE(torch.nn.Module):
    """A top-k softmax router over all tokens, then :class:`GroupedExperts`. ``aux_loss`` (set by each forward)
    is the Switch Transformer load-balancing loss: experts x sum over experts of (fraction of routed slots) x
    (mean router probability)."""

    def __init__(self, num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(DIM, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        experts = probs.shape[-1]
        routed = torch.nn.functional.one_hot(index, experts).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux_loss = experts * (routed * probs.mean(dim=0)).sum()
        return self.experts(flat, index, weights).view_as(x)


class MoeBlock(torch.nn.Module):
    """Pre-norm attention + :class:`MoE`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.moe = Attention(), MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoeLM(torch.nn.Module):
    """:class:`TinyLM` with :class:`MoeBlock` s: ``forward(tokens, labels)`` returns the cross-entropy plus
    ``aux_loss_coef`` x the blocks' load-balancing losses. ``_ep_plan`` (transformers' attribute and style
    name) says which modules hold experts to place on expert-parallel ranks."""

    _no_split_modules = ["MoeBlock"]
    _ep_plan = {"blocks.*.moe.experts": "ep_dispatch_experts"}

    def __init__(self, layers: int = 2, aux_loss_coef: float = 0.01) -> None:
        super().__init__()
        self.aux_loss_coef = aux_loss_coef
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(MoeBlock() for _ in range(layers))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def example_inputs(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``torchrig plan`` feeds one step: token ids as their own labels."""
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return ids, ids

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        return loss + self.aux_loss_coef * sum(block.moe.aux_loss for block in self.blocks)
