"""Throughput, step time, MFU and peak memory, measured over windows of optimizer steps (issue 21).

Why windows: timing each step needs a clock read per step and, on a GPU, a device sync per step
(the host runs ahead of the queued kernels), which slows the very thing measured. The monitor
instead counts optimizer steps (one increment in the step plan's ``optimizer_step``, added only
when ``throughput_monitor.enabled``) and reads ``time.perf_counter()`` once every
``log_every_n_steps`` steps. On a GPU without a sync, each reading is taken when the host has
queued the step, not when the device finished it; because steps queue behind each other, the
difference of two readings a window apart is the device's time for the window once the queue is
in steady state (the first window after start may read short). ``sync_at_log`` synchronizes
before each reading for an exact boundary, at the cost of one sync per window.

What is counted, per window (all processes together; per device = ÷ world size):

* samples: what ``accelerator.throughput.update(samples=..., tokens=...)`` reported, when the
  user calls it; otherwise the active prepared DataLoader's ``total_batch_size`` (one global
  batch) × gradient-accumulation steps per optimizer step (a short last batch counts full);
* tokens: reported ones, else samples × ``tokens_per_sample``;
* FLOPs: ``flops_per_sample`` × samples, else ``flops_per_token`` × tokens, where
  ``flops_per_token`` defaults to :func:`transformer_flops_per_token` of the first prepared model
  (6·N for the matmuls of forward and backward over N non-embedding parameters, plus
  12·layers·d_model·seq for attention's QKᵀ and AV, forward and backward; Kaplan et al. 2020,
  as torchtitan and Megatron count it) when the model says its layers and width;
  :func:`measure_flops_per_step` measures a real step with ``FlopCounterMode`` instead;
* MFU: achieved FLOP/s ÷ (peak FLOP/s of one device × world size); the peak comes from
  ``peak_flops_per_device`` or :data:`PEAK_FLOPS` by GPU name and precision (dense, no
  sparsity). On a CPU there is no table: MFU is reported only with ``peak_flops_per_device``;
* peak memory: ``torch.cuda.max_memory_allocated`` on a CUDA device, else the process's max
  RSS (``getrusage``), in GiB.

The arithmetic is :func:`window_rates`, a pure function of the readings. Only the main process
measures and logs (``accelerator.log``, keys ``throughput/...`` and ``memory/...``).
"""

from __future__ import annotations

import collections
import re
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from torchrig.estimate.hardware import PEAK_FLOPS  # the table lives with the plan's GPU specs; re-exported here


def gpu_table_key(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` key of a CUDA device name (``"NVIDIA H100 80GB HBM3"`` → ``h100-sxm``)."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    if "h100" in words:
        return "h100-pcie" if "pcie" in words else "h100-nvl" if "nvl" in words else "h100-sxm"
    for key in ("h200", "b200", "a100", "l40s", "l4", "a10g", "v100", "mi300x"):
        if key in words:
            return key
    return None


def precision_of(mixed_precision: str) -> str:
    """The table's precision column for a ``mixed_precision`` value (no → tf32 when torch allows it)."""
    if mixed_precision in ("bf16", "fp16", "fp8"):
        return mixed_precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device_name: str, mixed_precision: str) -> float | None:
    """Peak FLOP/s of one device from :data:`PEAK_FLOPS`, None when the GPU or precision is not there."""
    key = gpu_table_key(device_name)
    return None if key is None else PEAK_FLOPS[key].get(precision_of(mixed_precision))


def device_peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """Peak FLOP/s of a CUDA device from the table; None elsewhere (a CPU's depends on too much)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(device), mixed_precision)


def transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (matmuls, forward 2·N + backward 4·N) + 12·L·d·seq (attention)."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


#: Attribute names under which models (Hugging Face configs, nn.Transformer) state depth and width.
_LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_WIDTH_NAMES = ("hidden_size", "n_embd", "d_model", "dim")


def _dimension(model: nn.Module, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(model, "config", None), model):
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def non_embedding_params(model: nn.Module) -> int:
    """Parameters that take part in matmuls: all but ``nn.Embedding`` weights (a lookup, no FLOPs)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedded)


def estimate_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """:func:`transformer_flops_per_token` for a model that states its layers and width
    (``config.num_hidden_layers``/``n_layer``/``num_layers`` and ``hidden_size``/``n_embd``/``d_model``,
    on the model or its ``config``); None when it does not."""
    layers, width = _dimension(model, _LAYER_NAMES), _dimension(model, _WIDTH_NAMES)
    if layers is None or width is None:
        return None
    return transformer_flops_per_token(non_embedding_params(model), layers, width, seq_len)


def measure_flops_per_step(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (e.g. forward + backward on one batch) counted by
    ``torch.utils.flop_counter.FlopCounterMode`` — exact for what it counts (matmuls, convolutions,
    attention), no elementwise work. Divide by the step's tokens or samples for the config.
    Pitfall: on a CPU, torch's fused ``scaled_dot_product_attention`` kernel is not counted (reads
    as 0 FLOPs); on CUDA the flash and memory-efficient kernels are."""
    from torch.utils.flop_counter import FlopCounterMode  # loads torch._decomp tables: only when asked

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


@attrs.frozen
class Reading:
    """The counters at one measurement: time, optimizer steps, samples and tokens so far."""

    time: float
    steps: int
    samples: float
    tokens: float


def window_rates(first: Reading, last: Reading, *, world_size: int, flops_per_sample: float | None = None,
                 flops_per_token: float | None = None, peak_flops_per_device: float | None = None) -> dict[str, float]:
    """Rates between two readings: step time, samples/s and tokens/s (all and per device), MFU.

    A rate whose count is zero (nothing reported) is left out, and so is MFU without FLOPs or peak."""
    seconds, steps = last.time - first.time, last.steps - first.steps
    if seconds <= 0 or steps <= 0:
        return {}
    out = {"throughput/step_time": seconds / steps}
    samples, tokens = last.samples - first.samples, last.tokens - first.tokens
    if samples > 0:
        out["throughput/samples_per_sec"] = samples / seconds
        out["throughput/samples_per_sec_per_device"] = samples / seconds / world_size
    if tokens > 0:
        out["throughput/tokens_per_sec"] = tokens / seconds
        out["throughput/tokens_per_sec_per_device"] = tokens / seconds / world_size
    flops = None
    if flops_per_sample is not None and samples > 0:
        flops = flops_per_sample * samples
    elif flops_per_token is not None and tokens > 0:
        flops = flops_per_token * tokens
    if flops is not None and peak_flops_per_device:
        out["throughput/mfu"] = flops / seconds / (peak_flops_per_device * world_size)
    return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated memory of this process: CUDA's allocator on a CUDA device, else max RSS."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class ThroughputMonitor:
    """``accelerator.throughput``: counts optimizer steps, measures every ``log_every_n_steps``.

    ``latest`` holds the last measured values (the keys logged), for a progress line. ``log`` is
    called with them and the step count; ``samples_per_step`` says how many samples one optimizer
    step took when the user reports none (None: unknown)."""

    def __init__(self, options: Any, *, world_size: int, device: torch.device, active: bool,
                 log: Callable[[Mapping[str, float], int], None],
                 samples_per_step: Callable[[], int | None],
                 flops_per_token: Callable[[], float | None], peak_flops_per_device: float | None) -> None:
        self.options = options
        self.world_size = world_size
        self.device = device
        #: Whether this process measures (the main one, with the monitor enabled).
        self.active = active
        self.latest: dict[str, float] = {}
        #: Optimizer steps taken since the monitor started.
        self.steps = 0
        self._log = log
        self._samples_per_step = samples_per_step
        self._flops_per_token = flops_per_token
        self._flops_resolved = False
        self._estimated_flops_per_token: float | None = None
        self.peak_flops_per_device = peak_flops_per_device
        self._next = 1  # the first step's end starts the first window (compile and warm-up stay out)
        self._samples = 0.0
        self._tokens = 0.0
        self._reported = False
        self._readings: collections.deque[Reading] = collections.deque(maxlen=options.window_size + 1)

    def update(self, samples: float | None = None, tokens: float | None = None) -> None:
        """Report what the current optimizer step processed, all processes together (call it on
        every step once, or never: then samples come from the prepared DataLoader)."""
        self._reported = True
        if samples is not None:
            self._samples += samples
        if tokens is not None:
            self._tokens += tokens

    def wrap_optimizer_step(self, step: Callable[[Any], bool]) -> Callable[[Any], bool]:
        """The plan's ``optimizer_step``, counting steps; a measurement every ``log_every_n_steps``."""

        def optimizer_step(optimizer: Any) -> bool:
            result = step(optimizer)
            self.steps += 1
            if self.steps >= self._next:
                self._measure()
            return result

        return optimizer_step

    def _read(self, new_steps: int) -> Reading:
        if self.options.sync_at_log and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self._reported:
            per_step = self._samples_per_step()
            if per_step is not None:
                self._samples += per_step * new_steps
                if self.options.tokens_per_sample is not None:
                    self._tokens += per_step * new_steps * self.options.tokens_per_sample
        return Reading(time.perf_counter(), self.steps, self._samples, self._tokens)

    def _measure(self) -> None:
        reading = self._read(self.steps - self._readings[-1].steps if self._readings else 0)
        self._readings.append(reading)
        self._next = self.steps + self.options.log_every_n_steps
        if len(self._readings) == 1:
            return
        if not self._flops_resolved:
            self._flops_resolved = True
            if self.options.flops_per_sample is None and self.options.flops_per_token is None:
                self._estimated_flops_per_token = self._flops_per_token()
        values = window_rates(self._readings[0], reading, world_size=self.world_size,
                              flops_per_sample=self.options.flops_per_sample,
                              flops_per_token=self.flops_per_token,
                              peak_flops_per_device=self.peak_flops_per_device)
        values["memory/peak_allocated_gib"] = peak_memory_gib(self.device)
        self.latest = values
        self._log(values, self.steps)

    @property
    def flops_per_token(self) -> float | None:
        """The configured FLOPs per token, else the estimate (known after the first measurement)."""
        if self.options.flops_per_token is not None:
            return self.options.flops_per_token
        return self._estimated_flops_per_token

    def progress(self) -> str:
        """The latest values, short, for a progress line ("" before the first measurement)."""
        v = self.latest
        parts = []
        if "throughput/tokens_per_sec" in v:
            parts.append(f"{v['throughput/tokens_per_sec']:.0f} tok/s")
        if "throughput/samples_per_sec" in v:
            parts.append(f"{v['throughput/samples_per_sec']:.1f} samples/s")
        if "throughput/step_time" in v:
            parts.append(f"{v['throughput/step_time'] * 1e3:.1f} ms/step")
        if "throughput/mfu" in v:
            parts.append(f"MFU {v['throughput/mfu']:.1%}")
        if "memory/peak_allocated_gib" in v:
            parts.append(f"peak {v['memory/peak_allocated_gib']:.2f} GiB")
        return ", ".join(parts)


__all__ = [
    "PEAK_FLOPS",
    "Reading",
    "ThroughputMonitor",
    "device_peak_flops",
    "estimate_flops_per_token",
    "gpu_table_key",
    "measure_flops_per_step",
    "non_embedding_params",
    "peak_flops",
    "peak_memory_gib",
    "precision_of",
    "transformer_flops_per_token",
    "window_rates",
]
