"""Loss normalised by the step's global valid-token count (issue 37): under data parallel 2 x gradient
accumulation 2 with ragged padding, ``accelerator.backward(loss_sum, num_tokens=n)`` and transformers'
convention (``accelerator.token_count`` -> ``num_items_in_batch``) give the gradient of the one-process
full-batch loss (sum over every valid token / their number), under DDP and FSDP2; the mean of
per-micro-batch means, what ``backward(loss_mean)`` gives, does not. Bad counts and a strategy whose
engine owns accumulation are refused by name."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torchrig import Accelerator, GradScalerKwargs
from torchrig.testing.contracts import rank_environment

TIMEOUT = 240  # seconds a pooled run may take before the test gives up (not a measurement)
VOCAB, HIDDEN, SEQ = 16, 16, 6
RANKS, MICRO_STEPS = 2, 2
#: Valid (non-padding) tokens of each sample, per (rank, micro-step): ragged, so a token's weight in the
#: mean of micro-batch means differs from its weight in the full batch.
LENGTHS = {(0, 0): (6, 5), (0, 1): (1, 2), (1, 0): (2, 1), (1, 1): (6, 6)}
TOLERANCE = 1e-5


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def tiny_model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def micro_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, labels) of one micro-batch: labels past a sample's length are -100 (padding)."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    for row, length in enumerate(LENGTHS[(rank, step)]):
        labels[row, length:] = -100
    return ids, labels


def token_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def token_mean(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def reference_gradients() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(full-batch gradient: every valid token of every rank and micro-step / their number, the mean of
    the four micro-batch means' gradients), computed in one process."""
    batches = [micro_batch(rank, step) for rank in range(RANKS) for step in range(MICRO_STEPS)]
    model = tiny_model()
    token_mean(model, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
    full = [param.grad.clone() for param in model.parameters()]
    model.zero_grad()
    for ids, labels in batches:
        (token_mean(model, ids, labels) / len(batches)).backward()
    naive = [param.grad.clone() for param in model.parameters()]
    return full, naive


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _window(accelerator: Accelerator, model: nn.Module, mode: str) -> list[torch.Tensor]:
    """One accumulation window of this rank's two micro-batches; the synced gradients, whole."""
    micro = [micro_batch(accelerator.process_index, step) for step in range(MICRO_STEPS)]
    count = accelerator.token_count([labels for _, labels in micro], shift=False) if mode == "items" else None
    for ids, labels in micro:
        with accelerator.accumulate(model):
            if mode == "tokens":
                accelerator.backward(token_sum(model, ids, labels), num_tokens=(labels != -100).sum())
            elif mode == "items":  # transformers' loss_function(..., num_items_in_batch=count): sum / count
                accelerator.backward(token_sum(model, ids, labels) / count, num_items_in_batch=count)
            else:
                accelerator.backward(token_mean(model, ids, labels))
    grads = [_full(param.grad).clone() for param in accelerator.unwrap_model(model).parameters()]
    model.zero_grad()
    return grads


def _gradients_under(ctx, strategy: str) -> dict[str, object]:
    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()  # an earlier task's Accelerator must not hold the world for its strategy
        accelerator = Accelerator(cpu=True, strategy=strategy, gradient_accumulation_steps=MICRO_STEPS)
        model = tiny_model()
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen: dict[str, object] = {mode: _window(accelerator, model, mode) for mode in ("tokens", "items", "naive")}
        seen["step_token_count"] = accelerator.step_token_count
        accelerator.end_training()
        return seen


def _sequence_shard(ctx) -> dict[str, object]:
    """Context parallel 2 (FSDP2 over ``dp_shard_cp``): both ranks run the same micro-batches, each on its
    half of the sequence (the model is per-token, so no ring attention is needed: CPU runs it); the counts
    add up over ``cp`` and FSDP2's mean over ``dp_shard_cp`` is undone."""
    from torchrig import ParallelismConfig

    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=MICRO_STEPS,
                                  parallelism_config=ParallelismConfig(cp_size=2))
        model = tiny_model()
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        half = slice(ctx.rank * SEQ // 2, (ctx.rank + 1) * SEQ // 2)
        for step in range(MICRO_STEPS):
            ids, labels = micro_batch(0, step)
            ids, labels = ids[:, half], labels[:, half]
            with accelerator.accumulate(model):
                accelerator.backward(token_sum(model, ids, labels), num_tokens=(labels != -100).sum())
        grads = [_full(param.grad).clone() for param in accelerator.unwrap_model(model).parameters()]
        accelerator.end_training()
        return {"grads": grads, "step_token_count": accelerator.step_token_count}


@pytest.mark.multiprocess
def test_context_parallel_shards_count_their_tokens_once(gloo_pool):
    micro = [micro_batch(0, step) for step in range(MICRO_STEPS)]
    reference = tiny_model()
    token_mean(reference, torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])).backward()
    full = [param.grad for param in reference.parameters()]
    for rank, seen in enumerate(gloo_pool.run(_sequence_shard, timeout=TIMEOUT)):
        assert _distance(seen["grads"], full) < TOLERANCE, rank
        assert seen["step_token_count"] == sum(LENGTHS[(0, 0)]) + sum(LENGTHS[(0, 1)]), rank


def _distance(left: list[torch.Tensor], right: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(left, right, strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradients_normalised_by_the_global_token_count_equal_the_full_batch_gradient(gloo_pool, strategy):
    full, naive = reference_gradients()
    assert _distance(full, naive) > 100 * TOLERANCE  # the ragged padding makes the naive mean really differ
    total = sum(length for lengths in LENGTHS.values() for length in lengths)
    for rank, seen in enumerate(gloo_pool.run(_gradients_under, strategy, timeout=TIMEOUT)):
        assert _distance(seen["tokens"], full) < TOLERANCE, (rank, "num_tokens")
        assert _distance(seen["items"], full) < TOLERANCE, (rank, "num_items_in_batch")
        assert _distance(seen["naive"], naive) < TOLERANCE, (rank, "the naive mean is what torch computes")
        assert _distance(seen["naive"], full) > 100 * TOLERANCE, rank
        assert seen["step_token_count"] == total, rank


@pytest.fixture
def single_accelerator():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO_STEPS)
    model = tiny_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    yield accelerator, model
    accelerator.end_training()


def test_one_process_accumulation_normalises_by_the_window_count(single_accelerator):
    accelerator, model = single_accelerator
    micro = [micro_batch(0, step) for step in range(MICRO_STEPS)]
    reference = tiny_model()
    token_mean(reference, torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])).backward()
    for ids, labels in micro:
        with accelerator.accumulate(model):
            accelerator.backward(token_sum(model, ids, labels), num_tokens=int((labels != -100).sum()))
    assert _distance([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]) < TOLERANCE
    assert accelerator.step_token_count == sum(LENGTHS[(0, 0)]) + sum(LENGTHS[(0, 1)])


@pytest.mark.parametrize(("given", "error", "words"), [
    (-1, ValueError, "num_tokens must be >= 0"),
    (2.5, TypeError, "num_tokens must be the number of valid tokens"),
    (True, TypeError, "num_tokens must be the number of valid tokens"),
    (torch.tensor(3.0), TypeError, "integer count"),
    (torch.tensor([1, 2]), ValueError, "must be one count"),
])
def test_a_bad_token_count_is_refused_by_name(single_accelerator, given, error, words):
    accelerator, model = single_accelerator
    ids, labels = micro_batch(0, 0)
    with pytest.raises(error, match=words):
        accelerator.backward(token_sum(model, ids, labels), num_tokens=given)


def test_token_normalisation_refuses_an_ambiguous_or_empty_step(single_accelerator):
    accelerator, model = single_accelerator
    ids, labels = micro_batch(0, 0)
    with pytest.raises(ValueError, match="not both"):
        accelerator.backward(token_sum(model, ids, labels), num_tokens=3, num_items_in_batch=3)
    with accelerator.accumulate(model):  # the window's first micro-step: a mean, not a sum
        accelerator.backward(token_mean(model, ids, labels))
    with accelerator.accumulate(model), pytest.raises(ValueError, match="on every micro-step of a window or on none"):
        accelerator.backward(token_sum(model, ids, labels), num_tokens=3)
    with pytest.raises(ValueError, match="num_items_in_batch=0"):
        accelerator.backward(token_sum(model, ids, labels), num_items_in_batch=0)
    with pytest.raises(TypeError, match="num_items_in_batch must be"):
        accelerator.backward(token_sum(model, ids, labels), num_items_in_batch=1.5)
    with pytest.raises(KeyError, match="needs 'labels'"):
        accelerator.token_count({"input_ids": ids})
    assert accelerator.token_count([{"labels": labels}, labels], shift=False) == 2 * sum(LENGTHS[(0, 0)])
    assert accelerator.token_count({"labels": labels}) == sum(LENGTHS[(0, 0)]) - 2  # position 0 predicts nothing


def test_a_step_without_a_valid_token_is_refused():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tiny_model())
    ids, labels = micro_batch(0, 0)
    with pytest.raises(ValueError, match="no valid token on any of its 1 data-parallel rank"):
        accelerator.backward(token_sum(model, ids, labels) * 0, num_tokens=0)
    accelerator.end_training()


def _deepspeed_refuses(ctx) -> str:
    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        accelerator = Accelerator(cpu=True, strategy="deepspeed", gradient_accumulation_steps=MICRO_STEPS)
        model = tiny_model()
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        ids, labels = micro_batch(ctx.rank, 0)
        try:
            accelerator.backward(token_sum(model, ids, labels), num_tokens=int((labels != -100).sum()))
        except ValueError as error:
            return str(error)
        finally:
            accelerator.end_training()
        return "not refused"


@pytest.mark.multiprocess
def test_a_strategy_whose_engine_owns_accumulation_refuses_num_tokens_by_name(gloo_pool):
    pytest.importorskip("deepspeed")
    for message in gloo_pool.run(_deepspeed_refuses, timeout=TIMEOUT):
        assert "the 'deepspeed' strategy's engine owns gradient accumulation" in message


def test_fp16_loss_scaling_composes_with_the_token_normalisation():
    """The GradScaler scales the summed loss; the W/N factor is applied to the scaled gradients and
    unscaling gives the full-batch gradient (within fp16 autocast's error, far from the naive mean)."""
    # a small first scale: the summed loss's fp16 gradients at torch's 65536 overflow (the scaler would skip)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=MICRO_STEPS,
                              kwargs_handlers=[GradScalerKwargs(init_scale=16.0)])
    model = tiny_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    micro = [micro_batch(0, step) for step in range(MICRO_STEPS)]
    reference = tiny_model()
    token_mean(reference, torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])).backward()
    naive = tiny_model()
    for ids, labels in micro:
        (token_mean(naive, ids, labels) / MICRO_STEPS).backward()
    for ids, labels in micro:
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss_sum = token_sum(model, ids, labels)
            accelerator.backward(loss_sum, num_tokens=int((labels != -100).sum()))
    accelerator.unscale_gradients()
    grads = [p.grad for p in model.parameters()]
    error = _distance(grads, [p.grad for p in reference.parameters()])
    assert error < 1e-3 < _distance(grads, [p.grad for p in naive.parameters()]), error
    accelerator.end_training()


def test_a_transformers_model_given_token_count_as_num_items_in_batch_trains_on_the_full_batch_loss():
    """transformers' convention end to end: ``token_count`` counts the shifted labels as the model's
    ``ForCausalLMLoss`` does, and the micro-steps' gradients equal the whole batch's ``.loss`` gradient."""
    hf_models = pytest.importorskip("torchrig.testing.hf_models")
    generator = torch.Generator().manual_seed(3)
    micro = []
    for lengths in ((8, 2), (3, 5)):
        ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ), generator=generator)
        labels = ids.clone()
        for row, length in enumerate(lengths):
            labels[row, length:] = -100
        micro.append({"input_ids": ids, "labels": labels})
    reference = hf_models.build("llama")
    reference(input_ids=torch.cat([b["input_ids"] for b in micro]), labels=torch.cat([b["labels"] for b in micro])).loss.backward()
    naive = hf_models.build("llama")
    for batch in micro:
        (naive(**batch).loss / len(micro)).backward()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(micro))
    model = hf_models.build("llama")
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    count = accelerator.token_count(micro)
    assert count == (8 - 1) + (2 - 1) + (3 - 1) + (5 - 1)  # position 0 of each row predicts nothing
    for batch in micro:
        with accelerator.accumulate(model):
            loss = model(**batch, num_items_in_batch=count).loss
            accelerator.backward(loss, num_items_in_batch=count)
    grads = [p.grad for p in model.parameters()]
    assert _distance(grads, [p.grad for p in reference.parameters()]) < TOLERANCE
    assert _distance(grads, [p.grad for p in naive.parameters()]) > 100 * TOLERANCE
    accelerator.end_training()
