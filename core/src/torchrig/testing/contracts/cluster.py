"""The cluster contract: what every cluster-environment plugin must do, as tests to inherit.

A cluster plugin is tested from *recorded environments* — the variables a real job sets — so no
cluster is needed::

    from torchrig.testing.contracts import ClusterContract

    class TestMyScheduler(ClusterContract):
        cluster = "pbs"
        priority = 35
        environments = [
            # (environment, expected ClusterInfo fields), or None where the plugin must decline
            ({"PBS_TASKNUM": "1", "PBS_NP": "4", ...}, {"rank": 1, "world_size": 4, "master_addr": "n01"}),
            ({"HOME": "/root"}, None),
        ]
        malformed = [({"PBS_TASKNUM": "x", "PBS_NP": "4"}, "PBS_TASKNUM")]

Checks: each recorded environment gets the expected answer (or ``None``), with ``source`` set to
the plugin's name, from a read-only mapping (the plugin must not modify it); every answer is
consistent (ranks below sizes, a rendezvous address and port for several processes);
auto-detection among *all installed* cluster plugins picks this plugin for the environments it
answers, unless a plugin of higher priority recognises them too (so the declared priority is
right against the others); malformed environments raise
``ValueError`` naming the variable; the manifest declares ``priority``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest


def _host() -> Any:
    from torchrig import PluginHost

    return PluginHost()


class ClusterContract:
    """Behaviour every cluster plugin must show. Subclass and set ``cluster`` and ``environments``."""

    #: The cluster plugin's name (``cluster: <name>`` in configuration).
    cluster: ClassVar[str] = ""
    #: The priority its manifest declares.
    priority: ClassVar[int] = 0
    #: Recorded environments and the :class:`~torchrig.ClusterInfo` fields expected from each,
    #: or None where the plugin must decline.
    environments: ClassVar[Sequence[tuple[Mapping[str, str], Mapping[str, Any] | None]]] = ()
    #: Malformed environments and the text (a variable name) the ``ValueError`` must contain.
    malformed: ClassVar[Sequence[tuple[Mapping[str, str], str]]] = ()

    @pytest.fixture
    def plugin(self) -> Any:
        if not self.cluster:
            pytest.skip("ClusterContract is abstract: set `cluster` in the subclass")
        assert self.environments, f"{type(self).__name__} must record at least one environment (environments)"
        return _host().select("cluster", self.cluster)

    def _answered(self) -> list[tuple[Mapping[str, str], Mapping[str, Any]]]:
        return [(env, expected) for env, expected in self.environments if expected is not None]

    def test_recorded_environments_get_the_expected_answers(self, plugin: Any) -> None:
        for environ, expected in self.environments:
            answer = plugin.torchrig_detect_cluster(environ=types.MappingProxyType(dict(environ)))
            if expected is None:
                assert answer is None, f"{self.cluster} must decline {dict(environ)}, answered {answer}"
                continue
            assert answer is not None, f"{self.cluster} declined {dict(environ)}"
            got = {field: getattr(answer, field) for field in expected}
            assert got == dict(expected), f"for {dict(environ)}"
            assert answer.source == self.cluster, "ClusterInfo.source must name the plugin that answered"

    def test_answers_are_consistent(self, plugin: Any) -> None:
        for environ, _ in self._answered():
            info = plugin.torchrig_detect_cluster(environ=dict(environ))
            assert 0 <= info.rank < info.world_size, info
            assert 0 <= info.local_rank < info.local_world_size <= info.world_size, info
            assert 0 <= info.node_rank < info.num_nodes <= info.world_size, info
            if info.world_size > 1:
                assert info.master_addr, f"{info}: several processes need a rendezvous address"
                assert info.master_port is not None and 1 <= info.master_port <= 65535, info

    def test_auto_detection_respects_its_priority(self, plugin: Any) -> None:
        host = _host()
        host.select_auto("cluster")
        priorities = {info.name: info.priority for info in host.plugins("cluster")}
        won = 0
        for environ, _ in self._answered():
            answer = host.hook.torchrig_detect_cluster(environ=dict(environ))
            if answer.source == self.cluster:
                won += 1
                continue
            assert priorities.get(answer.source, float("-inf")) > self.priority, (
                f"among the installed cluster plugins {answer.source!r} answered {dict(environ)} instead of "
                f"{self.cluster!r} (priority {self.priority}) without a higher priority")
        assert won, f"auto-detection never picked {self.cluster!r} for its recorded environments"

    def test_malformed_environments_name_the_variable(self, plugin: Any) -> None:
        if not self.malformed:
            pytest.skip(f"{type(self).__name__} records no malformed environment (malformed)")
        for environ, expected in self.malformed:
            with pytest.raises(ValueError) as raised:
                plugin.torchrig_detect_cluster(environ=dict(environ))
            assert expected in str(raised.value), str(raised.value)

    def test_manifest_declares_its_priority(self, plugin: Any) -> None:
        assert _host().info("cluster", self.cluster).priority == self.priority


__all__ = ["ClusterContract"]
