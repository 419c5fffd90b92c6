"""The pipeline's default loss (no ``parallelism_config.pp_loss_fn``) is the batch's cross-entropy summed
over its valid tokens (label != -100) and divided by their number — not the mean of the micro-batches'
means, which weighs a token of a heavily padded micro-batch more (issue 37). With ragged padding over
``pp_size`` 2 and two micro-batches, each batch's loss and the accumulated gradients of two batches
(``accelerator.backward(loss * n, num_tokens=n)``) equal a one-process reference's token mean; the mean
of micro-batch means does not."""

from __future__ import annotations

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import SEQ, VOCAB, PipeLM

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180  # seconds a pooled run may take before the test gives up (not a measurement)
TOLERANCE = 1e-5
#: Valid tokens of each sample of the two batches of one optimizer step; the batch splits into two
#: micro-batches of two samples, the first mostly padding.
LENGTHS = ((1, 2, 8, 7), (8, 8, 3, 1))


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + index)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS[index]), SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (len(LENGTHS[index]), SEQ), generator=generator)
    for row, length in enumerate(LENGTHS[index]):
        labels[row, length:] = -100
    return tokens, labels


def cross_entropy(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def reference() -> dict:
    """One process: each batch's token-mean loss and the mean of its micro-batches' means; the gradients
    of the two batches' token sum over their token count."""
    torch.manual_seed(0)
    model = PipeLM()
    batches = [batch(index) for index in range(len(LENGTHS))]
    losses = [float(cross_entropy(model, tokens, labels)) for tokens, labels in batches]
    naive = [float((cross_entropy(model, tokens[:2], labels[:2]) + cross_entropy(model, tokens[2:], labels[2:])) / 2)
             for tokens, labels in batches]
    tokens, labels = (torch.cat(parts) for parts in zip(*batches, strict=True))
    cross_entropy(model, tokens, labels).backward()
    return {"losses": losses, "naive": naive, "grads": {name: p.grad for name, p in model.named_parameters()}}


def _pipelined(ctx) -> dict:
    from torchrig import Accelerator, ParallelismConfig

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=len(LENGTHS),
                                  parallelism_config=ParallelismConfig(pp_size=2, pp_split_points=["layers.2"],
                                                                       pp_microbatches=2))
        torch.manual_seed(0)
        model = PipeLM()
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for index in range(len(LENGTHS)):
            tokens, labels = batch(index)
            with accelerator.accumulate(model):
                loss = model(tokens, target=labels)  # the batch's token mean, on every rank
                valid = int((labels != -100).sum())
                accelerator.backward(loss * valid, num_tokens=valid)
            losses.append(float(loss))
        grads = {}
        for name, param in accelerator.unwrap_model(model).named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = grad.detach().clone()
        accelerator.end_training()
        return {"losses": losses, "grads": grads}


def test_the_default_pipeline_loss_is_the_token_mean_of_the_batch_not_the_mean_of_micro_batch_means(gloo_pool):
    expected = reference()
    assert all(abs(a - b) > 100 * TOLERANCE for a, b in zip(expected["losses"], expected["naive"], strict=True))
    for rank, seen in enumerate(gloo_pool.run(_pipelined, timeout=TIMEOUT)):
        assert seen["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE), rank
        assert seen["grads"], rank
        for name, grad in seen["grads"].items():
            assert torch.allclose(grad, expected["grads"][name], atol=TOLERANCE), (rank, name)
