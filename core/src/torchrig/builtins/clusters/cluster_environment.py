"""What the built-in cluster environments share: reading a process's place out of its variables.

Named after the kind, as Lightning Fabric's ``ClusterEnvironment`` base: each environment module
(:mod:`.torchelastic`, :mod:`.slurm`, :mod:`.mpi`, :mod:`.env`, :mod:`.process_group`, :mod:`.local`) reads
integers, ports and rank/size pairs the same way, and every malformed value is a ``ValueError`` naming the
plugin and the variable. Torch-free; imports nothing of torchrig.
"""

from __future__ import annotations

from collections.abc import Mapping


def int_var(environ: Mapping[str, str], name: str, plugin: str, *, minimum: int = 0) -> int:
    raw = environ.get(name)
    if raw is None:
        raise ValueError(f"{plugin}: {name} is not set")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{plugin}: {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{plugin}: {name}={raw!r} must be >= {minimum}")
    return value


def port_var(environ: Mapping[str, str], name: str, plugin: str) -> int:
    port = int_var(environ, name, plugin, minimum=1)
    if port > 65535:
        raise ValueError(f"{plugin}: {name}={environ[name]!r} is not a TCP port (1-65535)")
    return port


def check_ranks(plugin: str, rank: tuple[str, int], size: tuple[str, int]) -> None:
    (rank_name, rank_value), (size_name, size_value) = rank, size
    if not 0 <= rank_value < size_value:
        raise ValueError(f"{plugin}: {rank_name}={rank_value} is not below {size_name}={size_value}")


def local_layout(environ: Mapping[str, str], plugin: str, rank: int, world_size: int,
                  default_local_world: int) -> tuple[int, int]:
    """``(local_rank, local_world_size)`` from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when set."""
    if "LOCAL_RANK" not in environ:
        return (rank if default_local_world == world_size else 0), default_local_world
    local_rank = int_var(environ, "LOCAL_RANK", plugin)
    if "LOCAL_WORLD_SIZE" in environ:
        local_world = int_var(environ, "LOCAL_WORLD_SIZE", plugin, minimum=1)
    else:  # not said: the default layout, stretched to hold this local rank
        local_world = min(max(default_local_world, local_rank + 1), world_size)
    check_ranks(plugin, ("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world))
    if local_world > world_size:
        raise ValueError(f"{plugin}: LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world_size}")
    return local_rank, local_world


__all__ = ["check_ranks", "int_var", "local_layout", "port_var"]
