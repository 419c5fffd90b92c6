"""What the core itself checkpoints besides the strategy's models and optimizers.

* RNG, per rank: python ``random``, numpy (when imported), torch CPU, and every CUDA device
  when CUDA is initialised — stored as tensors and ints so ``torch.load(weights_only=True)``
  reads them.
* The run fingerprint: the configuration that changes what training computes (not where it
  runs or logs) and each dataloader's order-defining settings, hashed; a resume with a
  different fingerprint is refused with a diff unless explicitly allowed.

RNG policy at another world size: rank ``r`` restores rank ``r``'s streams when the checkpoint
has them; a rank the checkpoint did not have reseeds every generator from
``(checkpoint step, rank)`` so the run stays deterministic and ranks stay distinct.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from torchrig.config.options import CORE_SECTIONS

#: Configuration keys that say where and how a run executes or reports, not what it computes.
NON_FINGERPRINT_KEYS = frozenset({
    "use_cpu", "device", "cluster", "num_processes", "num_machines", "min_machines", "machine_rank", "main_process_ip",
    "main_process_port", "rdzv_backend", "rdzv_endpoint", "gpu_ids", "log_with", "disable_plugins", "strict_config",
    "dataloader_config.non_blocking",
})
#: Core option sections of the same kind: outputs, process-group setup, compilation, what a
#: preemption does (a requeued job may well change it), what is profiled and measured, the device
#: mesh (a layout: a resume under another mesh reshards; the manifest's ``layout`` records it,
#: checkpoint/topology.py).
NON_FINGERPRINT_SECTIONS = ("project_config", "init_process_group_kwargs", "dynamo_config", "preemption",
                            "profile_kwargs", "throughput_monitor", "parallelism_config")
#: The core's other option sections: they define what training computes, at any world size.
FINGERPRINT_SECTIONS = tuple(section.key for section in CORE_SECTIONS if section.key not in NON_FINGERPRINT_SECTIONS)


def capture_rng() -> dict[str, Any]:
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    import torch

    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype("uint32"), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed_rng(step: int, rank: int) -> None:
    """Deterministic fresh streams for a rank the checkpoint had no RNG state for."""
    import torch

    seed = int.from_bytes(hashlib.sha256(f"torchrig-resume:{step}:{rank}".encode()).digest()[:4], "little")
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def _plain(value: Any) -> Any:
    """JSON-comparable form of a config value."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, Mapping):
            return {str(k): _plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_plain(v) for v in value]
        return repr(value)


def fingerprint_config(items: Iterable[tuple[str, Any]], strategy_sections: Iterable[str]) -> dict[str, Any]:
    """The configuration keys that define what training computes.

    ``strategy_sections`` are the option sections of the selected strategy; other strategies'
    sections do not matter to this run.
    """
    counted = {*strategy_sections, *FINGERPRINT_SECTIONS}
    return {key: _plain(value) for key, value in items
            if key not in NON_FINGERPRINT_KEYS and ("." not in key or key.split(".")[0] in counted)}


def describe_dataloader(loader: Any) -> dict[str, Any]:
    """What decides the order of a prepared dataloader's samples (world size aside)."""
    state = loader.state_dict() if hasattr(loader, "state_dict") else {}
    dataset = getattr(loader, "dataset", None)
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    sampler = getattr(loader, "sampler", None)
    return {
        "dataset": type(dataset).__name__, "dataset_length": length, "batch_size": getattr(loader, "batch_size", None),
        "total_batch_size": state.get("total_batch_size"), "seed": state.get("seed"),
        "seed_source": getattr(loader, "seed_source", None),
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "drop_last": getattr(getattr(loader, "base_dataloader", loader), "drop_last", None),
        "split_batches": getattr(loader, "split_batches", None),
    }


def comparable_data_order(saved: list[dict[str, Any]], current: list[dict[str, Any]], loaders: list[Any]
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The saved and current data-order descriptions, as a resume compares them.

    A loader whose seed was drawn from the global RNG (the script never chose one: no
    ``data_seed``, no generator of its own) gets the checkpoint's seed back with its position,
    so its seed is not part of the comparison; a seed the script chose is (changing it changes
    the order the run asked for). ``seed_source`` itself is bookkeeping, never a difference.
    """
    def strip(order: list[dict[str, Any]]) -> list[dict[str, Any]]:
        stripped = []
        for index, entry in enumerate(order):
            drawn = index < len(loaders) and getattr(loaders[index], "seed_source", None) == "global_rng"
            stripped.append({k: v for k, v in entry.items() if k != "seed_source" and not (drawn and k == "seed")})
        return stripped

    return strip(list(saved)), strip(list(current))


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def diff(saved: Mapping[str, Any], current: Mapping[str, Any], defaulted: Collection[str] = ()) -> list[str]:
    """``key: checkpoint old, now new`` for each key that differs. A key in ``defaulted`` (this
    run leaves it at its default) that the checkpoint does not record is no difference: the key
    is newer than the checkpoint, and its default is what the run that wrote it did."""
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key not in saved and key in defaulted:
            continue
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if old != new:
            lines.append(f"{key}: checkpoint {old!r}, now {new!r}")
    return lines


__all__ = ["FINGERPRINT_SECTIONS", "NON_FINGERPRINT_KEYS", "NON_FINGERPRINT_SECTIONS", "capture_rng",
           "comparable_data_order", "describe_dataloader", "diff", "digest", "fingerprint_config", "reseed_rng",
           "restore_rng"]
