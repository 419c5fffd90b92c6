"""The precision contract: what every precision plugin must do, as tests to inherit.

::

    from torchrig.testing.contracts import PrecisionContract

    class TestMyPrecision(PrecisionContract):
        precision = "fp8"
        autocast_dtype = "float8_e4m3fn"
        device = "cuda"

Each test builds a real ``Accelerator(mixed_precision=precision)`` in the test process (one
process; the strategy is ``single``) on ``device`` and checks: matmuls inside ``autocast()`` run
in ``autocast_dtype``, and so do those of the prepared model's forward (observed with
:mod:`torchrig.testing.effects`, for ``forward_dtype_modules``); a training step updates full-precision (fp32) master weights; a
loss-scaling precision scales the gradients and *skips* a step whose gradients overflowed (the
parameters stay, ``optimizer_step_was_skipped`` says so, the scale backs off), and a precision
without loss scaling never silently skips a step; the run's checkpoint round-trips, with the
files the plugin declares (``checkpoint_files``: ``scaler.pt`` for fp16's GradScaler). Tests skip
cleanly where ``device`` is not available.
"""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

import pytest

from torchrig.testing.contracts._common import rank_environment, tiny_batch, tiny_model

#: ``Accelerator`` arguments selecting a device plugin by name.
_DEVICE_ARGUMENTS = {"cpu": {"cpu": True}}


def device_available(device: str) -> bool:
    """Whether torch can use ``device`` (``"cpu"``, ``"cuda"``, ``"mps"``, or any torch device type)."""
    import torch

    if device == "cpu":
        return True
    if device == "mps":
        return bool(torch.backends.mps.is_available())
    module = getattr(torch, device, None)
    return bool(module is not None and callable(getattr(module, "is_available", None)) and module.is_available())


class PrecisionContract:
    """Behaviour every precision plugin must show. Subclass and set ``precision``."""

    #: The precision plugin's name (``mixed_precision: <name>``).
    precision: ClassVar[str] = ""
    #: ``torch`` dtype name matmuls run in under ``autocast()`` (``"bfloat16"``); None: fp32.
    autocast_dtype: ClassVar[str | None] = None
    #: Whether the plugin scales the loss (and so skips steps whose gradients overflowed).
    scales_loss: ClassVar[bool] = False
    #: The device plugin to run on; the tests skip where torch cannot use it.
    device: ClassVar[str] = "cpu"
    #: Files the plugin adds to every checkpoint (``torchrig_checkpoint_state``), e.g. ``("scaler.pt",)``.
    checkpoint_files: ClassVar[tuple[str, ...]] = ()
    #: The modules of the prepared model whose forward must compute in ``autocast_dtype`` (a selector of
    #: :class:`torchrig.testing.effects.ForwardRecord`: a name, a class or a predicate ``(name, module)``);
    #: None: all. A plugin that converts modules to tensor subclasses (fp8) selects the others here and
    #: checks the converted ones with :func:`torchrig.testing.effects.assert_modules_converted`.
    forward_dtype_modules: ClassVar[Any] = None

    @pytest.fixture
    def accelerator(self, tmp_path: pathlib.Path) -> Any:
        if not self.precision:
            pytest.skip("PrecisionContract is abstract: set `precision` in the subclass")
        if not device_available(self.device):
            pytest.skip(f"precision {self.precision!r} is tested on {self.device!r}, which is not available here")
        from torchrig import Accelerator

        with rank_environment(0, 1, {"TORCHRIG_DEVICE": self.device} if self.device not in _DEVICE_ARGUMENTS else {}):
            yield Accelerator(mixed_precision=self.precision, project_dir=str(tmp_path),
                              **_DEVICE_ARGUMENTS.get(self.device, {}))

    def _prepared(self, accelerator: Any, lr: float = 0.1) -> tuple[Any, Any, Any, Any]:
        import torch

        model = tiny_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        x, y = tiny_batch(0)
        return model, optimizer, x.to(accelerator.device), y.to(accelerator.device)

    def test_autocast_runs_matmuls_in_its_dtype(self, accelerator: Any) -> None:
        import torch

        x = torch.randn(4, 8, device=accelerator.device)
        w = torch.randn(5, 8, device=accelerator.device)
        self._prepared(accelerator)  # the step plan (and its autocast) is built at prepare
        with accelerator.autocast():
            out = torch.nn.functional.linear(x, w)
        assert out.dtype == getattr(torch, self.autocast_dtype or "float32"), out.dtype

    def test_the_prepared_forward_computes_in_its_dtype(self, accelerator: Any) -> None:
        """Observed in the prepared model's own forward (not a bare op under ``autocast()``): a plugin
        whose autocast never reaches the model computes in fp32 and fails here."""
        import torch

        from torchrig.testing.effects import record_forward_dtypes

        model, _, x, _ = self._prepared(accelerator)
        with record_forward_dtypes(model) as record:
            model(x)
        record.assert_dtype(getattr(torch, self.autocast_dtype or "float32"), self.forward_dtype_modules)

    def test_a_step_updates_full_precision_master_weights(self, accelerator: Any) -> None:
        import torch

        from torchrig.testing.effects import assert_master_weights

        model, optimizer, x, y = self._prepared(accelerator)
        before = [p.detach().clone() for p in model.parameters()]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        assert torch.isfinite(loss), loss
        accelerator.backward(loss)
        optimizer.step()
        assert not accelerator.optimizer_step_was_skipped, "a step with finite gradients must be applied"
        params = list(model.parameters())
        assert all(p.dtype == torch.float32 for p in params), "master weights must stay fp32"
        assert_master_weights(optimizer, torch.float32, model=model)  # and the optimizer steps those
        assert any(not torch.equal(p, b) for p, b in zip(params, before)), "the step must change the parameters"

    def test_gradients_are_scaled_only_by_a_loss_scaling_precision(self, accelerator: Any) -> None:
        import torch

        model, optimizer, x, y = self._prepared(accelerator)
        reference = tiny_model().to(accelerator.device)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        got = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
        want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.98, "gradients point elsewhere"
        ratio = float(got.norm() / want.norm())
        if self.scales_loss:
            assert ratio > 2.0, f"a loss-scaling precision must scale the gradients before unscaling (ratio {ratio})"
            optimizer.step()
            assert not accelerator.optimizer_step_was_skipped
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
        else:
            assert abs(ratio - 1.0) < 0.05, f"gradients must be true-scale (ratio {ratio})"

    def test_overflowing_gradients_are_skipped_only_by_a_loss_scaling_precision(self, accelerator: Any) -> None:
        import torch

        model, optimizer, x, y = self._prepared(accelerator)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        before = [p.detach().clone() for p in model.parameters()]
        next(iter(model.parameters())).grad.fill_(float("inf"))
        optimizer.step()
        if self.scales_loss:
            assert accelerator.optimizer_step_was_skipped, "a step with inf gradients must be skipped"
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a skipped step changed weights"
        else:
            assert not accelerator.optimizer_step_was_skipped, "a precision without loss scaling must not skip steps"

    def test_checkpoint_round_trips_with_the_plugin_state(self, accelerator: Any, tmp_path: pathlib.Path) -> None:
        import torch

        model, optimizer, x, y = self._prepared(accelerator)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        target = tmp_path / "checkpoint"
        accelerator.save_state(str(target))
        saved = [p.detach().clone() for p in model.parameters()]
        for name in self.checkpoint_files:
            assert (target / name).is_file(), f"the checkpoint lacks {name} ({sorted(p.name for p in target.iterdir())})"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        accelerator.load_state(str(target))
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))


__all__ = ["PrecisionContract", "device_available"]
