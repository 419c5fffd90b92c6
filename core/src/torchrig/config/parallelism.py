"""Checks of ``parallelism_config`` (the device mesh) before any process starts, and the size
inference the strategy that builds the mesh repeats with the real world size.

Why here and generic: the launcher must refuse a mesh that cannot fit the job before starting
workers, and the core never names a strategy — so which axes a strategy can build is read from
its manifest (``PluginManifest.parallelism_axes``). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from torchrig.config.options import BORROWED_AXES, PARALLELISM_AXES, ParallelismConfig, TorchTensorParallelPlugin
from torchrig.config.schema import Problem

SECTION = "parallelism_config"


def key_of(axis: str) -> str:
    return f"{SECTION}.{axis}_size"


def infer_sizes(sizes: Mapping[str, int], world_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``sizes`` with a ``-1`` axis replaced by what the world size leaves for it; the problems
    found as ``(axis, message)`` (every one, not only the first)."""
    problems: list[tuple[str, str]] = []
    auto = [axis for axis, size in sizes.items() if size == -1]
    fixed = math.prod(size for size in sizes.values() if size > 0)
    given = ", ".join(f"{axis}_size={size}" for axis, size in sizes.items() if size != 1) or "every size 1"
    resolved = dict(sizes)
    if len(auto) > 1:
        for axis in auto[1:]:
            problems.append((axis, f"-1 is allowed on one axis only; {auto[0]}_size is -1 already (set this one "
                                   "to a number)"))
    elif len(auto) == 1:
        if world_size % fixed:
            problems.append((auto[0], f"-1 cannot be inferred: the world size {world_size} is not a multiple of the "
                                      f"other sizes' product {fixed} ({given})"))
        else:
            resolved[auto[0]] = world_size // fixed
    elif fixed != world_size:
        problems.append((_culprit(sizes), f"the sizes multiply to {fixed} ({given}) but the world size is "
                                          f"{world_size}; their product must equal it (or set one axis, usually "
                                          "dp_shard_size, to -1)"))
    return resolved, problems


def _culprit(sizes: Mapping[str, int]) -> str:
    """The axis a product mismatch is reported on: the last one set, else dp_shard."""
    set_axes = [axis for axis, size in sizes.items() if size != 1]
    return set_axes[-1] if set_axes else "dp_shard"


def parallelism_problems(
    values: Mapping[str, object],
    where: Callable[[str], str | None],
    *,
    world_size: int | None,
    strategy: str | None,
    declared_axes: Mapping[str, tuple[str, ...]],
    declared_tp_styles: Mapping[str, tuple[str, ...]] | None = None,
) -> list[Problem]:
    """Every problem of the resolved ``parallelism_config`` values: a product that does not match
    the world size (when it is known), two ``-1`` axes, axes > 1 that the selected strategy
    does not declare (naming the strategies that do), and ``tp_plan`` styles it does not declare
    (``declared_tp_styles``: strategy -> ``PluginManifest.tp_styles``). ``where(key)`` gives a key's source."""
    sizes = {axis: values.get(key_of(axis)) for axis in PARALLELISM_AXES}
    if not all(isinstance(size, int) for size in sizes.values()):
        return []  # a bad value is reported by the section's own validation
    checked: dict[str, int] = {axis: int(size) for axis, size in sizes.items()}  # type: ignore[arg-type]
    problems = []
    if checked["tp"] == 1:  # nothing would apply them: refused rather than ignored
        for key in ("tp_plan", "loss_parallel", "async_tp"):
            if values.get(f"{SECTION}.{key}"):
                problems.append(Problem(f"{SECTION}.{key}", "has no effect with tp_size 1; set "
                                        f"{SECTION}.tp_size (or remove {key})", where(f"{SECTION}.{key}")))
    problems += _pipeline_problems(values, checked["pp"], where)
    if strategy is not None and declared_tp_styles is not None:
        problems += _tp_plan_problems(values.get(f"{SECTION}.tp_plan"), strategy, declared_tp_styles.get(strategy, ()),
                                      where)
    if all(size == 1 for size in checked.values()):
        # no mesh asked for: the strategy's own layout applies (an ep_size alone has no dp_shard to borrow from)
        return problems + _expert_problems(values, checked, strategy, declared_axes, where)
    resolved = checked
    if world_size is not None:
        resolved, found = infer_sizes(checked, world_size)
        problems += [Problem(key_of(axis), message, where(key_of(axis))) for axis, message in found]
    elif sum(1 for size in checked.values() if size == -1) > 1:
        _, found = infer_sizes(checked, 0)
        problems += [Problem(key_of(axis), message, where(key_of(axis))) for axis, message in found]  # two -1 only
    problems += _expert_problems(values, resolved, strategy, declared_axes, where)
    if strategy is not None:
        supported = declared_axes.get(strategy, ())
        for axis, size in resolved.items():
            if size == 1 or size == -1 or axis in supported:  # -1 with an unknown world: judged at start
                continue
            others = sorted(name for name, axes in declared_axes.items() if axis in axes and name != strategy)
            instead = (f"use strategy {' or '.join(others)}" if others else
                       "no installed strategy declares it")
            problems.append(Problem(key_of(axis), (
                f"{axis}_size={size} but the strategy {strategy!r} does not build a {axis} axis (it declares "
                f"{', '.join(supported) or 'none'}); {instead}"), where(key_of(axis))))
    return problems


#: Axes expert parallelism does not compose with yet (refused by name rather than run untested).
_NOT_WITH_EP = {"tp": "experts split over tp and ep together", "cp": "context-parallel shards routed to experts",
                "pp": "pipeline stages holding experts"}


def _expert_problems(values: Mapping[str, object], sizes: Mapping[str, int], strategy: str | None,
                     declared_axes: Mapping[str, tuple[str, ...]], where: Callable[[str], str | None]) -> list[Problem]:
    """``ep_size`` (borrowed from ``dp_shard``, :data:`BORROWED_AXES`): it must divide the resolved
    ``dp_shard_size`` (-1 not yet inferred: judged at start), the selected strategy must declare an ``ep``
    axis, and the axes EP is not built with yet are refused naming both keys."""
    ep = values.get(key_of("ep"))
    if not isinstance(ep, int) or isinstance(ep, bool) or ep <= 1:
        return []  # 1: no expert parallelism; a bad value is reported by the section's own validation
    key, lender = key_of("ep"), BORROWED_AXES["ep"]
    problems = []
    if strategy is not None and "ep" not in declared_axes.get(strategy, ()):
        others = sorted(name for name, axes in declared_axes.items() if "ep" in axes and name != strategy)
        instead = f"use strategy {' or '.join(others)}" if others else "no installed strategy declares it"
        problems.append(Problem(key, f"ep_size={ep} but the strategy {strategy!r} does not build an ep axis; {instead}",
                                where(key)))
    if sizes.get(lender, 1) > 0 and sizes.get(lender, 1) % ep:
        problems.append(Problem(key, (
            f"ep_size={ep} does not divide {key_of(lender)} ({sizes.get(lender, 1)}): expert parallelism borrows its "
            f"ranks from {lender} (each ep group is ep ranks of one {lender} group); set {key_of(lender)} to a multiple "
            f"of {ep}"), where(key)))
    for axis, what in _NOT_WITH_EP.items():
        if sizes.get(axis, 1) > 1:
            problems.append(Problem(key, (
                f"ep_size={ep} with {axis}_size={sizes[axis]} is not built yet ({what}); use ep_size with "
                f"dp_shard_size and dp_replicate_size only, or set {key_of(axis)} to 1"), where(key)))
    return problems


def _tp_plan_problems(plan: object, strategy: str, styles: tuple[str, ...],
                      where: Callable[[str], str | None]) -> list[Problem]:
    """Each ``tp_plan`` entry whose style the selected strategy does not declare, naming the entry
    and listing the names it does declare (a strategy declaring none accepts no plan)."""
    if not isinstance(plan, Mapping):
        return []  # no plan, or a bad value the section's own validation reports
    key = f"{SECTION}.tp_plan"
    known = (f"styles the strategy {strategy!r} accepts: {', '.join(styles)}" if styles else
             f"the strategy {strategy!r} declares no tensor-parallel styles")
    return [Problem(key, f"{pattern!r}: unknown style {style!r}; {known} (or null: leave the module whole)", where(key))
            for pattern, style in plan.items() if style is not None and style not in styles]


def _pipeline_problems(values: Mapping[str, object], pp: int, where: Callable[[str], str | None]) -> list[Problem]:
    """Pipeline keys without a pipeline (refused rather than ignored), and split points that do not
    make ``pp_size`` stages. A pipeline with no split at all is the strategy's to judge at ``prepare``:
    ``pp_split_fn`` is Python-only, so the launcher cannot see it, and the model may declare its own
    pipeline plan (docs/parallelism.md)."""
    problems = []
    if pp == 1:
        for key in ("pp_split_points", "pp_split_fn", "pp_microbatches", "pp_loss_fn"):
            if values.get(f"{SECTION}.{key}") is not None:
                problems.append(Problem(f"{SECTION}.{key}", f"has no effect with pp_size 1; set {SECTION}.pp_size "
                                        f"(or remove {key})", where(f"{SECTION}.{key}")))
        return problems
    points = values.get(f"{SECTION}.pp_split_points")
    interleaved = values.get(f"{SECTION}.pp_schedule") == "Interleaved1F1B"
    stages = len(points) + 1 if isinstance(points, list) else 0
    if interleaved and pp > 1 and stages and (stages % pp or stages < 2 * pp):
        problems.append(Problem(f"{SECTION}.pp_split_points", (
            f"{len(points)} split point(s) make {stages} stages; Interleaved1F1B needs a multiple of pp_size ({pp}), "
            f"at least {2 * pp} (two stages per rank)"), where(f"{SECTION}.pp_split_points")))
    elif isinstance(points, list) and pp > 1 and not interleaved and stages != pp:
        problems.append(Problem(f"{SECTION}.pp_split_points", (
            f"{len(points)} split point(s) make {len(points) + 1} stages but pp_size is {pp}; give pp_size - 1 = "
            f"{pp - 1} module names, each the first module of a stage"), where(f"{SECTION}.pp_split_points")))
    if points is not None and values.get(f"{SECTION}.pp_split_fn") is not None:
        problems.append(Problem(f"{SECTION}.pp_split_fn", "pp_split_points and pp_split_fn both split the model; "
                                "give one", where(f"{SECTION}.pp_split_fn")))
    return problems


def parallelism_argument(parallelism: object, tp_plugin: object) -> tuple[object, list[str]]:
    """``Accelerator(parallelism_config=..., torch_tp_plugin=...)`` as the section's argument: a
    ``ParallelismConfig`` or a mapping of its keys; Accelerate's older ``TorchTensorParallelPlugin
    (tp_size=N)`` sets ``tp_size``. Returns the argument (None: neither given) and the problems."""
    problems = []
    if parallelism is not None and not isinstance(parallelism, (ParallelismConfig, Mapping)):
        problems.append(f"Accelerator(parallelism_config=...): expected a ParallelismConfig or a mapping of its keys, "
                        f"got {type(parallelism).__name__}")
        parallelism = None
    if tp_plugin is None:
        return (dict(parallelism) if isinstance(parallelism, Mapping) else parallelism), problems
    if not isinstance(tp_plugin, TorchTensorParallelPlugin):
        problems.append(f"Accelerator(torch_tp_plugin=...): expected a TorchTensorParallelPlugin, got "
                        f"{type(tp_plugin).__name__}")
        return parallelism, problems
    if isinstance(parallelism, ParallelismConfig):
        return attrs.evolve(parallelism, tp_size=tp_plugin.tp_size), problems
    return {**(parallelism or {}), "tp_size": tp_plugin.tp_size}, problems


__all__ = ["SECTION", "infer_sizes", "key_of", "parallelism_argument", "parallelism_problems"]
