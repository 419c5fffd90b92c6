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

from torchrig.config.options import (
    BORROWED_AXES,
    PARALLELISM_AXES,
    ParallelismConfig,
    TorchTensorParallelPlugin,
    default_elastic_axis,
)
from torchrig.config.schema import Problem

SECTION = "parallelism_config"


def key_of(axis: str) -> str:
    return f"{SECTION}.{axis}_size"


def infer_sizes(sizes: Mapping[str, int], world_size: int, *, elastic_axis: str | None = None,
                ep_size: int = 1) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``sizes`` with a ``-1`` axis replaced by what the world size leaves for it; the problems
    found as ``(axis, message)`` (every one, not only the first). ``elastic_axis``: the world is
    an elastic round's (:meth:`ParallelismConfig.elastic_axis_for`), that axis is re-derived from it
    whatever its configured size (:func:`elastic_sizes`)."""
    if elastic_axis is not None:
        return elastic_sizes(sizes, world_size, elastic_axis, ep_size=ep_size)
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


def elastic_sizes(sizes: Mapping[str, int], world_size: int, axis: str, *,
                  ep_size: int = 1) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The sizes of an elastic round of ``world_size`` ranks: ``axis`` (a data-parallel axis) is the
    world size over the product of the others, which stay as configured. Refused (never a silently
    different layout): a -1 on another axis, a world that is not a multiple of the fixed axes'
    product (fewer ranks than it included), and an ``ep_size`` that does not divide the new
    ``dp_shard`` (expert parallelism borrows its ranks from it)."""
    problems = _inferred_off_the_elastic_axis(sizes, axis)
    fixed_axes = {other: size for other, size in sizes.items() if other != axis and size > 1}
    fixed = math.prod(fixed_axes.values())
    shown = " x ".join(f"{key_of(other)}={size}" for other, size in fixed_axes.items()) or "none"
    resolved = dict(sizes)
    if problems:
        return resolved, problems
    if world_size < fixed or world_size % fixed:
        problems.append((axis, (
            f"an elastic round of {world_size} ranks cannot keep the fixed axes ({shown}, {fixed} ranks per "
            f"{axis} index): {world_size} is not a multiple of {fixed}, so {key_of(axis)} cannot be re-derived; "
            f"launch a number of machines x processes per machine that is a multiple of {fixed} "
            "(--num_machines MIN:MAX, --num_processes)")))
        return resolved, problems
    resolved[axis] = world_size // fixed
    lender = BORROWED_AXES["ep"]
    if ep_size > 1 and resolved[lender] % ep_size:
        problems.append(("ep", (
            f"ep_size={ep_size} does not divide {key_of(lender)} {resolved[lender]}, re-derived for an elastic round "
            f"of {world_size} ranks ({key_of(axis)} absorbs the world size; fixed: {shown}): expert parallelism "
            f"borrows its ranks from {lender}; launch machine counts whose {lender} is a multiple of {ep_size}")))
    return resolved, problems


def _inferred_off_the_elastic_axis(sizes: Mapping[str, int], axis: str) -> list[tuple[str, str]]:
    """A -1 on another axis than the elastic one: which axis absorbs the world would be ambiguous."""
    return [(other, f"-1 in an elastic run: {axis}_size absorbs each round's world size ({SECTION}.elastic_axis) "
                    f"and the other axes stay fixed; give {other}_size a number")
            for other, size in sizes.items() if other != axis and size == -1]


def elastic_round_problems(sizes: Mapping[str, int], axis: str, *, ep_size: int, min_machines: int,
                           max_machines: int, processes_per_machine: int) -> list[tuple[str, str]]:
    """Before launch: every round ``--num_machines MIN:MAX`` can form (MIN..MAX machines of
    ``processes_per_machine`` ranks) must hold the fixed axes — one problem per axis naming the
    machine counts that cannot (a round of them would be refused at start, after a restart)."""
    bad: dict[str, list[int]] = {}
    first: dict[str, str] = {}
    for machines in range(min_machines, max_machines + 1):
        _, found = elastic_sizes(sizes, machines * processes_per_machine, axis, ep_size=ep_size)
        for culprit, message in found:
            bad.setdefault(culprit, []).append(machines)
            first.setdefault(culprit, message)
    return [(culprit, (
        f"an elastic world of min_machines {min_machines} to num_machines {max_machines}, {processes_per_machine} "
        f"process(es) per machine, would refuse a round of {' or '.join(map(str, counts))} machine(s) at start: "
        f"{first[culprit]}")) for culprit, counts in bad.items()]


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
    problems += _elastic_problems(values, checked, where)
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


def _elastic_problems(values: Mapping[str, object], sizes: Mapping[str, int],
                      where: Callable[[str], str | None]) -> list[Problem]:
    """``elastic_axis`` without an elastic world (it would have no effect); in an elastic world
    (``min_machines`` below ``num_machines``) with a mesh, a -1 off the elastic axis and every round
    size MIN..MAX that cannot hold the fixed axes (when ``num_processes`` says how many per machine)."""
    chosen, low, high = values.get(f"{SECTION}.elastic_axis"), values.get("min_machines"), values.get("num_machines")
    elastic = isinstance(low, int) and isinstance(high, int) and low < high
    if not elastic:
        if chosen is None:
            return []
        key = f"{SECTION}.elastic_axis"
        return [Problem(key, f"{chosen!r} has no effect: the world size is fixed (min_machines unset or equal to "
                             "num_machines); give --num_machines MIN:MAX for an elastic world, or remove elastic_axis",
                        where(key))]
    if all(size == 1 for size in sizes.values()):
        return []  # no mesh: the strategy's own layout spans the whole world, whatever its size
    axis = default_elastic_axis(chosen if isinstance(chosen, str) else None, sizes["dp_replicate"])
    ep = values.get(key_of("ep"))
    ep_size = ep if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1 else 1
    total = values.get("num_processes")
    if isinstance(total, int) and total % high == 0:
        found = elastic_round_problems(sizes, axis, ep_size=ep_size, min_machines=low, max_machines=high,
                                       processes_per_machine=total // high)
    else:  # processes per machine unknown yet: the -1 rule alone (the launcher checks the rounds once it knows)
        found = _inferred_off_the_elastic_axis(sizes, axis)
    return [Problem(key_of(culprit), message, where(key_of(culprit))) for culprit, message in found]


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


__all__ = ["SECTION", "elastic_round_problems", "elastic_sizes", "infer_sizes", "key_of", "parallelism_argument",
           "parallelism_problems"]
