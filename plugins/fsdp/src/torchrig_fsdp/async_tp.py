"""``parallelism_config.async_tp``: torch's asynchronous tensor parallel (micro-pipeline TP), which
overlaps the ``tp`` all-gathers/reduce-scatters with the matmuls they feed.

Why refused rather than ignored off CUDA or without compile: the overlap is an inductor pass
(``torch._inductor.config._micro_pipeline_tp``) over symmetric-memory kernels that exist for CUDA
only; without ``torch.compile`` the flag would change nothing, silently. docs/parallelism.md.
"""

from __future__ import annotations

from typing import Any

from torchrig.plugin import ConfigError, ParallelismConfig, RunContext, TorchDynamoPlugin

KEY = "parallelism_config.async_tp"


def problems(device_type: str, tp_size: int, compiled: bool) -> list[str]:
    """Why async TP cannot run here (empty: it can)."""
    found = []
    if tp_size <= 1:
        found.append(f"{KEY}: needs a tp axis (tp_size > 1); this mesh has none")
    if device_type != "cuda":
        found.append(f"{KEY}: needs CUDA devices (its overlap uses symmetric-memory kernels torch has for CUDA "
                     f"only); this run is on {device_type}: set async_tp: false")
    if not compiled:
        found.append(f"{KEY}: works through torch.compile (an inductor pass) and compilation is off; set "
                     "dynamo_config.backend (e.g. --dynamo_backend inductor) or async_tp: false")
    return found


def enable(run: RunContext, tp_mesh: Any) -> None:
    """Turn on micro-pipeline TP for the ``tp`` group when ``async_tp`` is set; raises
    :class:`ConfigError` naming the key when it cannot apply."""
    if not run.section(ParallelismConfig).async_tp:
        return
    dynamo = run.section(TorchDynamoPlugin)
    compiled = dynamo.backend not in ("no", None) and not dynamo.disable
    assert run.device is not None
    found = problems(run.device.device.type, tp_mesh.size() if tp_mesh is not None else 1, compiled)
    if found:
        raise ConfigError(found)
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


__all__ = ["KEY", "enable", "problems"]
