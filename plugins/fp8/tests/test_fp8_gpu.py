"""The real fp8 path on a CUDA GPU (marked ``gpu``: skipped cleanly without one): on compute
capability ≥ 8.9 the converted layers run ``torch._scaled_mm`` on float8 inputs, no emulation; below
it, fp8 without the emulation switch is refused naming the GPU."""

from __future__ import annotations

import pytest
import torch
from fp8_models import ProbedLM, batches, lm_loss

pytestmark = pytest.mark.gpu


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def test_fp8_runs_scaled_mm_on_a_capable_gpu():
    if _capability() < (8, 9):
        pytest.skip(f"needs compute capability 8.9 (this GPU: {_capability()})")
    from torchao.float8.float8_linear import Float8Linear
    from torchrig import Accelerator
    from torchrig.testing.effects import assert_modules_converted, record_forward_dtypes
    from torchrig_fp8.convert import conversion_report

    accelerator = Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    model = ProbedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert_modules_converted(accelerator.unwrap_model(model), Float8Linear, count=9)
    assert not conversion_report(accelerator.unwrap_model(model)).emulate
    with record_forward_dtypes(accelerator.unwrap_model(model)) as record:
        lm_loss(model, batches(1)[0].cuda())
    fp8_calls = [call.module for call in record.calls if "Float8TrainingTensor" in call.tensor_types]
    assert sorted(set(fp8_calls)) == sorted(conversion_report(accelerator.unwrap_model(model)).converted)
    # below the tensor subclass, the real fp8 GEMM (emulation would run plain mm instead)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        lm_loss(model, batches(1)[0].cuda()).backward()
    names = {event.key for event in profile.key_averages()}
    assert "aten::_scaled_mm" in names, sorted(names)
    optimizer.zero_grad()
    losses = []
    for tokens in batches(20):
        loss = lm_loss(model, tokens.cuda())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_fp8_without_emulation_is_refused_below_capability_8_9():
    if _capability() >= (8, 9):
        pytest.skip("this GPU runs fp8")
    from torchrig import Accelerator
    from torchrig.errors import ConfigError

    with pytest.raises(ConfigError, match="compute capability 8.9") as caught:
        Accelerator(mixed_precision="fp8")
    assert torch.cuda.get_device_name(0) in str(caught.value) and "fp8_config.emulate" in str(caught.value)
