"""Record the hook calls a plugin host makes, and assert their order.

Uses pluggy's hook-call monitoring, so it sees every hook call (firstresult, collecting,
historic) without changing any plugin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from torchrig.host.plugin_host import PluginHost


@attrs.frozen
class HookCall:
    """One recorded hook call: its name, keyword arguments, the plugins asked and the result."""

    name: str
    kwargs: dict[str, Any]
    #: Names of the plugins whose implementations pluggy was about to call, in call order.
    plugins: tuple[str, ...]
    result: Any = None


class HookRecorder:
    """``with HookRecorder(host) as rec: ...`` then ``rec.assert_order([...])``."""

    def __init__(self, host: PluginHost, *, prefix: str = "torchrig_") -> None:
        self.host = host
        self.prefix = prefix
        self.calls: list[HookCall] = []
        self._undo: Any = None
        self._pending: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []

    def start(self) -> HookRecorder:
        def before(hook_name: str, hook_impls: Sequence[Any], kwargs: dict[str, Any]) -> None:
            names = tuple(impl.plugin_name for impl in reversed(hook_impls))
            self._pending.append((hook_name, dict(kwargs), names))

        def after(outcome: Any, hook_name: str, hook_impls: Sequence[Any], kwargs: dict[str, Any]) -> None:
            name, call_kwargs, names = self._pending.pop()
            if name.startswith(self.prefix):
                result = outcome.get_result() if outcome.exception is None else outcome.exception
                self.calls.append(HookCall(name, call_kwargs, names, result))

        self._undo = self.host.pm.add_hookcall_monitoring(before, after)
        return self

    def stop(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def __enter__(self) -> HookRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def names(self) -> list[str]:
        return [call.name for call in self.calls]

    def calls_of(self, name: str) -> list[HookCall]:
        return [call for call in self.calls if call.name == name]

    def clear(self) -> None:
        self.calls.clear()

    def assert_order(self, expected: Iterable[str], *, exact: bool = False) -> None:
        """``expected`` hook names occur in this order (as a subsequence; the whole sequence
        when ``exact``)."""
        expected = list(expected)
        actual = self.names
        if exact:
            assert actual == expected, f"hook calls differ:\n  expected {expected}\n  actual   {actual}"
            return
        position = 0
        for name in actual:
            if position < len(expected) and name == expected[position]:
                position += 1
        assert position == len(expected), (
            f"hook {expected[position]!r} was not called after {expected[:position]}:\n  actual calls: {actual}"
        )


__all__ = ["HookCall", "HookRecorder"]
