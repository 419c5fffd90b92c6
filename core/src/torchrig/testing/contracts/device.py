"""The device contract: what every device plugin must do, as tests to inherit.

::

    from torchrig.testing.contracts import DeviceContract

    class TestMyDevice(DeviceContract):
        device = "xpu"          # the plugin's name
        device_type = "xpu"     # torch.device(...).type it claims
        priority = 80

Checks: the plugin *declines* (answers ``None``) where its hardware is missing — tested
everywhere, so a CUDA plugin is checked on a CPU-only machine too; where the hardware is present
it answers a :class:`~torchrig.DeviceBackend` for its device type with a process-group backend;
``prepare`` places the model and the batches on it and a step runs; seeding and RNG state
round-trip; the memory hooks answer; every built-in precision gets an answer (supported, or a
reason); the manifest declares the priority auto-detection uses. Hardware-dependent tests skip
cleanly, naming what is missing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from torchrig.testing.contracts._common import rank_environment, tiny_batch, tiny_model
from torchrig.testing.contracts.precision import device_available


def _runtime_and_run(device: str, local_rank: int = 0) -> tuple[Any, Any]:
    from torchrig import ClusterInfo, PluginHost, RunContext
    from torchrig.testing.hosts import resolved_config

    host = PluginHost()
    runtime = host.select("device", device)
    return runtime, RunContext(config=resolved_config(host=host), plugins=host, cluster=ClusterInfo(local_rank=local_rank))


class DeviceContract:
    """Behaviour every device plugin must show. Subclass and set ``device``."""

    #: The device plugin's name (``device: <name>`` in configuration).
    device: ClassVar[str] = ""
    #: The ``torch.device`` type it claims (defaults to ``device``).
    device_type: ClassVar[str] = ""
    #: The priority its manifest declares (auto-detection asks higher priorities first).
    priority: ClassVar[int] = 0

    def available(self) -> bool:
        """Whether the hardware is present here; override for devices torch does not know by name."""
        return device_available(self.device_type or self.device)

    @pytest.fixture
    def backend(self) -> Any:
        if not self.device:
            pytest.skip("DeviceContract is abstract: set `device` in the subclass")
        if not self.available():
            pytest.skip(f"device {self.device!r} is not available here")
        runtime, run = _runtime_and_run(self.device)
        return runtime.torchrig_select_device(run=run)

    def test_declines_without_its_hardware(self) -> None:
        if not self.device:
            pytest.skip("DeviceContract is abstract: set `device` in the subclass")
        if self.available():
            pytest.skip(f"device {self.device!r} is available here: declining cannot be observed")
        runtime, run = _runtime_and_run(self.device)
        assert runtime.torchrig_select_device(run=run) is None, "without its hardware a device plugin must answer None"

    def test_answers_a_backend_for_its_device(self, backend: Any) -> None:
        from torchrig import DeviceBackend

        assert isinstance(backend, DeviceBackend), backend
        assert backend.device.type == (self.device_type or self.device)
        assert backend.name == self.device
        assert isinstance(backend.dist_backend, str) and backend.dist_backend
        assert isinstance(backend.autocast_device_type, str) and backend.autocast_device_type
        described = backend.describe()
        assert {"name", "device", "backend"} <= set(described), described

    def test_prepare_places_model_and_batches_on_the_device(self, backend: Any, tmp_path: Any) -> None:
        import torch

        from torchrig import Accelerator

        with rank_environment(0, 1, {"TORCHRIG_DEVICE": self.device}):
            accelerator = Accelerator(project_dir=str(tmp_path))
            assert accelerator.device.type == backend.device.type
            model = tiny_model()
            x, y = tiny_batch(0)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
            model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
            assert {p.device.type for p in model.parameters()} == {backend.device.type}
            for bx, by in loader:
                assert bx.device.type == by.device.type == backend.device.type
                accelerator.backward(torch.nn.functional.cross_entropy(model(bx), by))
                optimizer.step()
                optimizer.zero_grad()

    def test_seed_and_rng_state_round_trip(self, backend: Any) -> None:
        import torch

        backend.manual_seed(1234)
        state = backend.get_rng_state()
        if state is None:  # the device draws from the CPU generator (seeded by set_seed)
            return
        first = torch.rand(16, device=backend.device)
        backend.set_rng_state(state)
        assert torch.equal(torch.rand(16, device=backend.device), first), "set_rng_state did not restore the state"
        backend.manual_seed(1234)
        assert torch.equal(torch.rand(16, device=backend.device), first), "manual_seed is not deterministic"

    def test_memory_hooks_answer(self, backend: Any) -> None:
        import torch

        backend.synchronize()
        backend.empty_cache()
        before = backend.memory_allocated()
        assert isinstance(before, int) and before >= 0
        block = torch.empty(1 << 20, device=backend.device)
        assert backend.memory_allocated() >= before
        del block

    def test_every_builtin_precision_gets_an_answer(self, backend: Any) -> None:
        for precision in ("no", "fp16", "bf16"):
            problem = backend.precision_problem(precision)
            assert problem is None or (isinstance(problem, str) and problem), (precision, problem)
        assert backend.precision_problem("no") is None, "every device must run full precision"

    def test_manifest_declares_its_priority(self) -> None:
        if not self.device:
            pytest.skip("DeviceContract is abstract: set `device` in the subclass")
        from torchrig import PluginHost

        assert PluginHost().info("device", self.device).priority == self.priority


__all__ = ["DeviceContract"]
