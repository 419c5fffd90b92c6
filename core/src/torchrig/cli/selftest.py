"""The script ``torchrig test`` launches: a short sanity run of the current configuration.

Each rank runs four checks in order — the Accelerator starts with the configured plugins, the
collectives agree across ranks, a tiny model trains (the loss falls and every rank ends with
the same weights), and a checkpoint round trip replays the next step bit-identically — and
prints one line per check. The main process then prints a summary. The exit status is 1 if any
check failed on any rank, so the launcher names the failing rank as it would for a real script.

Run it through ``torchrig test [launch flags]`` (it is ``torchrig launch [flags] -m
torchrig.cli.selftest``); ``python -m torchrig.cli.selftest`` runs it on one process. On several
machines the checkpoint check needs a temporary directory every machine sees: set ``TMPDIR`` to
a shared path.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchrig.accelerator import Accelerator
from torchrig.utils.operations import broadcast_object_list, gather_object

PREFIX = "torchrig test"
STEPS = 6
LR = 0.05


def _data() -> TensorDataset:
    """A learnable regression problem, the same on every rank (no seed of the script's needed)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(96, 8, generator=generator)
    targets = features @ torch.randn(8, 1, generator=generator)
    return TensorDataset(features, targets)


def _model() -> nn.Module:
    generator = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


class SelfTest:
    def __init__(self) -> None:
        self.accelerator: Accelerator | None = None
        #: (check, passed, detail or error), in the order run.
        self.results: list[tuple[str, bool, str]] = []
        self.model: Any = None
        self.optimizer: Any = None
        self.loader: Any = None

    def check(self, name: str, run: Callable[[], str]) -> bool:
        """Run one check; a failure is recorded with its message (the traceback goes to stderr)."""
        try:
            detail = run()
        except Exception as exc:
            traceback.print_exc()
            self.results.append((name, False, f"{type(exc).__name__}: {exc}"))
            return False
        self.results.append((name, True, detail))
        return True

    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else 0

    # -- the checks -------------------------------------------------------------------------------

    def start(self) -> str:
        self.accelerator = accelerator = Accelerator()
        config = accelerator.config
        return (f"strategy {config.get('strategy')}, precision {accelerator.mixed_precision}, device "
                f"{accelerator.device}, {accelerator.num_processes} process(es), "
                f"distributed type {accelerator.distributed_type.value}")

    def collectives(self) -> str:
        accelerator = self.accelerator
        assert accelerator is not None
        world = accelerator.num_processes
        total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)], device=accelerator.device))
        if total.item() != world * (world + 1) / 2:
            raise RuntimeError(f"all-reduce of 1..{world} gave {total.item()}, expected {world * (world + 1) / 2}")
        ranks = gather_object([accelerator.process_index])
        if ranks != list(range(world)):
            raise RuntimeError(f"gather_object of the ranks gave {ranks}")
        token = broadcast_object_list([f"from rank {accelerator.process_index}"])[0]
        if token != "from rank 0":
            raise RuntimeError(f"broadcast_object_list from rank 0 gave {token!r}")
        accelerator.wait_for_everyone()
        return "all-reduce, gather_object, broadcast_object_list and a barrier agree"

    def train(self) -> str:
        accelerator = self.accelerator
        assert accelerator is not None
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        loader = DataLoader(_data(), batch_size=8, shuffle=True)
        self.model, self.optimizer, self.loader = accelerator.prepare(model, optimizer, loader)
        losses = [self._epoch_loss() for _ in range(STEPS)]
        if not all(torch.isfinite(torch.tensor(losses))) or losses[-1] >= losses[0]:
            raise RuntimeError(f"the loss did not fall over {STEPS} epochs: {losses}")
        digests = gather_object([self._weights_digest()])
        if len(set(digests)) != 1:
            raise RuntimeError(f"the ranks ended with different weights (digests {digests})")
        return f"{STEPS} epochs, mean loss {losses[0]:.4f} -> {losses[-1]:.4f}; every rank has the same weights"

    def checkpoint(self) -> str:
        accelerator = self.accelerator
        assert accelerator is not None
        directory = broadcast_object_list([tempfile.mkdtemp(prefix="torchrig-test-")
                                           if accelerator.is_main_process else None])[0]
        try:
            accelerator.save_state(f"{directory}/checkpoint")
            expected = (self._epoch_loss(), self._weights_digest())
            accelerator.load_state(f"{directory}/checkpoint")
            replayed = (self._epoch_loss(), self._weights_digest())
            if replayed != expected:
                raise RuntimeError(f"after load_state the next epoch gave loss {replayed[0]!r}, weights "
                                   f"{replayed[1]}; before, {expected[0]!r}, {expected[1]}")
        finally:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                shutil.rmtree(directory, ignore_errors=True)
        return "save_state then load_state replays the next epoch bit-identically"

    # -- helpers ------------------------------------------------------------------------------------

    def _epoch_loss(self) -> float:
        """One pass over the prepared loader; the mean loss over every rank's batches."""
        accelerator = self.accelerator
        assert accelerator is not None
        total = torch.zeros((), device=accelerator.device)
        for features, targets in self.loader:
            loss = nn.functional.mse_loss(self.model(features).float(), targets.float())
            accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            total += loss.detach()
        return (accelerator.reduce(total, "mean") / len(self.loader)).item()

    def _weights_digest(self) -> str:
        """A digest of the full weights (gathered from shards where the strategy shards them)."""
        state = self.accelerator.get_state_dict(self.model)  # type: ignore[union-attr]
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode())
            digest.update(state[name].detach().cpu().float().numpy().tobytes())
        # a strategy may gather the full state on the main process only: share the main's view
        return broadcast_object_list([digest.hexdigest()[:16] if state else None])[0]

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> int:
        checks = [("start", self.start), ("collectives", self.collectives), ("train", self.train),
                  ("checkpoint", self.checkpoint)]
        for name, run in checks:
            passed = self.check(name, run)
            verdict = "ok" if passed else "FAILED"
            print(f"{PREFIX}: rank {self.rank()}: {name}: {verdict}: {self.results[-1][2]}", flush=True)
            if not passed:
                break  # the later checks build on the earlier ones
        failed = [name for name, passed, _ in self.results if not passed]
        skipped = [name for name, _ in checks[len(self.results):]]
        if self.accelerator is not None and not failed:
            if self.accelerator.is_main_process:
                print(f"{PREFIX}: all {len(checks)} checks passed on {self.accelerator.num_processes} process(es): "
                      f"{self.results[0][2]}", flush=True)
            self.accelerator.end_training()
            return 0
        print(f"{PREFIX}: rank {self.rank()}: failed: {', '.join(failed)}"
              + (f"; not run: {', '.join(skipped)}" if skipped else ""), file=sys.stderr, flush=True)
        return 1


def main() -> int:
    return SelfTest().run()


__all__ = ["SelfTest", "main"]


if __name__ == "__main__":
    sys.exit(main())

