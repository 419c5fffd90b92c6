"""The plugin host: discovery, manifests, selection and registration on pluggy.

One :class:`PluginHost` per Accelerator (or CLI command): plugin objects are instantiated per
host, so two Accelerators never share plugin state.

Lifecycle of a plugin (kind, name):

1. *discovered* from entry points (:mod:`torchrig.host.discovery`) — nothing imported;
2. its *manifest* loaded (torch-free) and checked: hook-API version, declared dependencies
   present (``find_spec``, no import), no second distribution claiming the same name, not
   disabled — then it is *available* and its manifest is registered, so its config section,
   CLI flags and validation are known;
3. *selected*: its runtime entry imported, instantiated and registered as ``"<kind>:<name>"``.
   Any failure here is one :class:`~torchrig.errors.PluginError` naming the plugin, its
   distribution, the cause and the fix.
"""

from __future__ import annotations

import difflib
import enum
import functools
import importlib.metadata as md
import importlib.util
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import pluggy

from torchrig.defaults.configuration import NAME as DEFAULTS_NAME
from torchrig.defaults.configuration import ConfigurationDefaults
from torchrig.errors import (
    PluginAPIVersionError,
    PluginConflictError,
    PluginDisabledError,
    PluginError,
    PluginImportError,
    PluginNotFoundError,
)
from torchrig.host.discovery import (
    PluginRecord,
    installed_distributions,
    load_reference,
    normalize_distribution_name,
    scan,
)
from torchrig.plugin import hookspecs
from torchrig.plugin.kinds import KIND_ORDER, PluginKind
from torchrig.plugin.manifest import PluginManifest
from torchrig.plugin.markers import PROJECT_NAME

#: Environment variable listing disabled plugins: ``"tracker:wandb,deepspeed"`` (a bare name
#: disables that name in every kind).
DISABLE_ENV = "TORCHRIG_DISABLE_PLUGINS"


def _call_alone(caller: Any, firstresult: bool, kwargs: dict[str, Any]) -> Any:
    """One implementation's own result (a collecting call of one returns a one-item list)."""
    result = caller(**kwargs)
    if firstresult:
        return result
    return result[0] if result else None


class PluginStatus(str, enum.Enum):
    SELECTED = "selected"
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    CONFLICT = "conflict"
    DISABLED = "disabled"


@attrs.define(eq=False)
class PluginInfo:
    """Everything known about one (kind, name), possibly provided by several distributions."""

    kind: PluginKind
    name: str
    records: list[PluginRecord]
    status: PluginStatus = PluginStatus.AVAILABLE
    reason: str | None = None
    #: The chosen record (None while in conflict).
    record: PluginRecord | None = None
    manifest: PluginManifest | None = None
    runtime: Any = None
    #: Unavailable because of a hook-API version mismatch (selecting it raises PluginAPIVersionError).
    api_mismatch: bool = False

    @property
    def key(self) -> str:
        return f"{self.kind.value}:{self.name}"

    @property
    def priority(self) -> int:
        return self.manifest.priority if self.manifest is not None else 0

    def describe(self) -> dict[str, Any]:
        """One row of ``torchrig plugins --json``."""
        record = self.record or self.records[0]
        row: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind.value,
            "distribution": record.distribution,
            "version": record.version,
            "status": self.status.value,
            "reason": self.reason,
            "summary": self.manifest.summary if self.manifest is not None else "",
        }
        if len(self.records) > 1:
            row["providers"] = [{"distribution": r.distribution, "version": r.version} for r in self.records]
        return row


def parse_disabled(values: Iterable[str]) -> set[str]:
    """Normalise ``["tracker:wandb", "deepspeed"]`` (and comma-separated strings) into keys."""
    out: set[str] = set()
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if not item:
                continue
            kind_text, sep, name = item.partition(":")
            if sep:
                out.add(f"{PluginKind.parse(kind_text).value}:{name.strip()}")
            else:
                out.add(item)
    return out


class PluginHost:
    """Discovers, loads and selects plugins for one run (or one CLI command).

    ``distributions`` replaces the installed distributions (tests pass fake ones; see
    :mod:`torchrig.testing`); ``disabled`` adds to the ``TORCHRIG_DISABLE_PLUGINS`` list.
    Wraps a :class:`pluggy.PluginManager` (``pm``). Registers only the torch-free configuration
    defaults; the runtime's and the launcher's default families are registered by whoever runs
    those hooks (:mod:`torchrig.defaults`), so the host never imports a layer above it.
    """

    def __init__(
        self,
        distributions: Iterable[md.Distribution] | None = None,
        *,
        disabled: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
        register_defaults: bool = True,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.disabled = parse_disabled([*disabled, environ.get(DISABLE_ENV, "")])
        self.generation = 0
        dists = installed_distributions() if distributions is None else list(distributions)
        self._infos: dict[str, PluginInfo] = {}
        for record in scan(dists):
            info = self._infos.setdefault(record.key, PluginInfo(record.kind, record.name, []))
            info.records.append(record)
        if register_defaults:
            self.register(ConfigurationDefaults(), DEFAULTS_NAME)
        for info in self._ordered(self._infos.values()):
            self._load_manifest(info)

    # -- queries ---------------------------------------------------------------------------

    @property
    def hook(self) -> Any:
        """pluggy's hook relay: ``host.hook.torchrig_detect_cluster(environ=...)``."""
        return self.pm.hook

    def plugins(self, kind: PluginKind | str | None = None) -> list[PluginInfo]:
        """Every discovered plugin (of ``kind``), in registration order."""
        infos = self._infos.values()
        if kind is not None:
            kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
            infos = [i for i in infos if i.kind is kind]
        return self._ordered(infos)

    def info(self, kind: PluginKind | str, name: str) -> PluginInfo:
        kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
        name, _, _ = name.partition("@")
        try:
            return self._infos[f"{kind.value}:{name}"]
        except KeyError:
            raise self._not_found(kind, name) from None

    def selected(self, kind: PluginKind | str) -> list[PluginInfo]:
        return [i for i in self.plugins(kind) if i.status is PluginStatus.SELECTED]

    def conflicts(self) -> list[PluginInfo]:
        return [i for i in self.plugins() if i.status is PluginStatus.CONFLICT]

    # -- selection -------------------------------------------------------------------------

    def select(self, kind: PluginKind | str, name: str) -> Any:
        """Import, instantiate and register the runtime object of plugin ``name``.

        ``name@distribution`` picks one provider when two distributions claim the name.
        Returns the runtime object. Raises a :class:`~torchrig.errors.PluginError` subclass.
        """
        kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
        plain, _, wanted_dist = name.partition("@")
        info = self.info(kind, plain)
        if info.status is PluginStatus.SELECTED:
            return info.runtime
        if info.status is PluginStatus.DISABLED:
            raise PluginDisabledError(
                f"{kind.value} plugin {plain!r} ({info.records[0].source}) is disabled ({info.reason}); "
                f"remove it from {DISABLE_ENV} / the 'disable_plugins' option to use it"
            )
        if info.status is PluginStatus.CONFLICT:
            if not wanted_dist:
                raise self._conflict_error(info)
            self._resolve_conflict(info, wanted_dist)
        if info.status is PluginStatus.UNAVAILABLE:
            raise self._unavailable_error(info)
        assert info.record is not None
        runtime = self._instantiate_runtime(info)
        self.register(runtime, info.key)
        info.runtime = runtime
        info.status = PluginStatus.SELECTED
        return runtime

    def select_auto(self, kind: PluginKind | str, only: str | None = None) -> list[PluginInfo]:
        """Register the runtime objects of every available plugin of an auto-detected kind
        (device, cluster), lowest priority first so the highest answers first; or only ``only``.

        A candidate that fails to import is skipped with its reason recorded (it is not what
        the user asked for); when ``only`` is given, its failure is an error.
        """
        kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
        if only is not None:
            self.select(kind, only)
            return self.selected(kind)
        candidates = [i for i in self.plugins(kind) if i.status is PluginStatus.AVAILABLE]
        for info in sorted(candidates, key=lambda i: (i.priority, i.name)):
            try:
                self.select(kind, info.name)
            except PluginError as exc:
                info.status = PluginStatus.UNAVAILABLE
                info.reason = str(exc)
        return self.selected(kind)

    def disable(self, names: Iterable[str]) -> None:
        """Disable plugins after discovery (the configuration's ``disable_plugins``): their
        manifests are unregistered and selecting them raises :class:`PluginDisabledError`."""
        self.disabled |= parse_disabled(names)
        for info in self._infos.values():
            if info.status is PluginStatus.DISABLED or not self._is_disabled(info):
                continue
            if info.status is PluginStatus.SELECTED:
                raise PluginDisabledError(f"{info.key} is disabled but was already selected")
            if self.pm.has_plugin(f"{info.key}#manifest"):
                self.unregister(f"{info.key}#manifest")
            info.status, info.reason = PluginStatus.DISABLED, f"disabled by {DISABLE_ENV} or 'disable_plugins'"

    def register(self, plugin: Any, name: str) -> None:
        """Register a plugin object under ``name`` (validated against the hook specs)."""
        if self.pm.has_plugin(name):
            raise PluginError(f"a plugin named {name!r} is already registered")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} does not match torchrig's hook specs: {exc}") from exc
        self.generation += 1

    def register_default(self, plugin: Any, name: str) -> None:
        """Register a family of the core's defaults (:mod:`torchrig.defaults`) unless it is already
        there: whoever builds a host that calls a family's hooks registers it, once."""
        if not self.pm.has_plugin(name):
            self.register(plugin, name)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.generation += 1

    def check_pending(self) -> None:
        """Fail if a registered plugin implements a hook torchrig does not define (a typo)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{exc}; see torchrig.plugin.hookspecs for the hooks that exist") from exc

    def iter_impls(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
        """``(plugin name, call)`` for each plugin implementing ``hook_name``, in pluggy's call
        order; ``call()`` calls that plugin's implementation alone (through pluggy, so hook
        monitoring sees it). For the rare places where the core must know
        who answered (step-plan owners) or isolate one plugin's failure (trackers). Never on
        the per-step path.
        """
        caller = getattr(self.pm.hook, hook_name)
        everyone = self.pm.get_plugins()
        for impl in reversed(caller.get_hookimpls()):
            if impl.wrapper or impl.hookwrapper:
                continue
            only = self.pm.subset_hook_caller(hook_name, remove_plugins=[p for p in everyone if p is not impl.plugin])
            yield impl.plugin_name, functools.partial(_call_alone, only, caller.spec.opts["firstresult"], kwargs)

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _ordered(infos: Iterable[PluginInfo]) -> list[PluginInfo]:
        return sorted(infos, key=lambda i: (KIND_ORDER.index(i.kind), i.priority, i.name))

    def _is_disabled(self, info: PluginInfo) -> bool:
        return info.key in self.disabled or info.name in self.disabled

    def _load_manifest(self, info: PluginInfo) -> None:
        if self._is_disabled(info):
            info.status, info.reason = PluginStatus.DISABLED, f"disabled by {DISABLE_ENV} or 'disable_plugins'"
            return
        if len({r.distribution for r in info.records}) > 1:
            sources = " and ".join(r.source for r in info.records)
            info.status, info.reason = PluginStatus.CONFLICT, f"provided by both {sources}"
            return
        info.record = info.records[0]
        self._check_record(info)

    def _check_record(self, info: PluginInfo) -> None:
        """Load and check the chosen record's manifest. A manifest that loads is registered even
        when the runtime cannot be used (missing dependency, no runtime entry), so the plugin's
        config section is still understood; selecting the plugin then fails with the reason."""
        record = info.record
        assert record is not None
        if record.manifest is None:
            return self._mark_unavailable(info, f"declares no manifest entry point in group {info.kind.manifest_group!r}")
        try:
            manifest_cls = load_reference(record.manifest)
        except Exception as exc:  # a broken manifest marks the plugin unavailable, never breaks the CLI
            return self._mark_unavailable(info, f"manifest {record.manifest!r} failed to import: {type(exc).__name__}: {exc}")
        if not (isinstance(manifest_cls, type) and issubclass(manifest_cls, PluginManifest)):
            return self._mark_unavailable(info, f"manifest {record.manifest!r} is not a torchrig.PluginManifest subclass")
        version = manifest_cls.api_version
        if version not in hookspecs.SUPPORTED_HOOK_API_VERSIONS:
            supported = ", ".join(str(v) for v in sorted(hookspecs.SUPPORTED_HOOK_API_VERSIONS))
            return self._mark_unavailable(
                info,
                f"written for hook API version {version}, but this torchrig supports {supported}; "
                f"install a {record.distribution} release made for this torchrig, or a torchrig that supports version {version}",
                api_mismatch=True,
            )
        info.manifest = manifest_cls()
        self.register(info.manifest, f"{info.key}#manifest")
        if record.runtime is None:
            return self._mark_unavailable(info, f"declares a manifest but no runtime entry point in group {info.kind.runtime_group!r}")
        missing = [m for m in manifest_cls.requires if importlib.util.find_spec(m) is None]
        if missing:
            return self._mark_unavailable(
                info, f"missing dependency {', '.join(repr(m) for m in missing)}; fix: {self._pip_fix(info)}"
            )
        info.status, info.reason = PluginStatus.AVAILABLE, None

    def _mark_unavailable(self, info: PluginInfo, reason: str, *, api_mismatch: bool = False) -> None:
        info.status, info.reason, info.api_mismatch = PluginStatus.UNAVAILABLE, reason, api_mismatch

    def _resolve_conflict(self, info: PluginInfo, wanted_dist: str) -> None:
        wanted = normalize_distribution_name(wanted_dist)
        for record in info.records:
            if normalize_distribution_name(record.distribution) == wanted:
                info.record = record
                self._check_record(info)
                return
        providers = ", ".join(r.distribution for r in info.records)
        raise PluginNotFoundError(
            f"{info.kind.value} plugin {info.name!r} is not provided by distribution {wanted_dist!r}; providers: {providers}"
        )

    def _instantiate_runtime(self, info: PluginInfo) -> Any:
        record = info.record
        assert record is not None and record.runtime is not None
        try:
            factory = load_reference(record.runtime)
            if not callable(factory):
                raise TypeError(f"entry point {record.runtime!r} is a {type(factory).__name__}, not a class or factory")
            return factory()
        except Exception as exc:
            tail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            raise PluginImportError(
                f"{info.kind.value} plugin {info.name!r} (distribution {record.source}) could not be loaded "
                f"from {record.runtime!r}: {tail}\nfix: {self._pip_fix(info, exc)}"
            ) from exc

    def _pip_fix(self, info: PluginInfo, exc: BaseException | None = None) -> str:
        record = info.record or info.records[0]
        hint = info.manifest.install_hint if info.manifest is not None else None
        if isinstance(exc, ModuleNotFoundError) and exc.name and hint is None:
            own_package = (record.runtime or "").partition(":")[0].split(".")[0]
            if exc.name.split(".")[0] != own_package:
                return f"pip install '{record.distribution}' (it needs the missing module {exc.name!r})"
        return f"pip install '{hint or record.distribution}'"

    def _unavailable_error(self, info: PluginInfo) -> PluginError:
        record = info.record or info.records[0]
        message = f"{info.kind.value} plugin {info.name!r} (distribution {record.source}) is unavailable: {info.reason}"
        if info.api_mismatch:
            return PluginAPIVersionError(message)
        return PluginImportError(message)

    def _conflict_error(self, info: PluginInfo) -> PluginConflictError:
        lines = "\n".join(f"  - {r.distribution} {r.version} ({r.runtime})" for r in info.records)
        choices = " or ".join(f"'{info.name}@{r.distribution}'" for r in info.records)
        uninstall = " or ".join(f"pip uninstall {r.distribution}" for r in info.records)
        return PluginConflictError(
            f"{info.kind.value} plugin {info.name!r} is provided by {len(info.records)} distributions:\n{lines}\n"
            f"choose one by selecting {choices}, or remove one ({uninstall})"
        )

    def _not_found(self, kind: PluginKind, name: str) -> PluginNotFoundError:
        names = sorted(i.name for i in self._infos.values() if i.kind is kind)
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        installed = ", ".join(names) if names else "none"
        return PluginNotFoundError(
            f"no {kind.value} plugin named {name!r}{hint}. Installed {kind.value} plugins: {installed}. "
            f"`torchrig plugins` lists every plugin and why one may be unavailable."
        )


__all__ = ["DEFAULTS_NAME", "DISABLE_ENV", "PluginHost", "PluginInfo", "PluginStatus", "parse_disabled"]
