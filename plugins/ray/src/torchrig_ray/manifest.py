"""Manifest of the ``ray`` cluster plugin: what torchrig knows about it without importing Ray or torch.

``requires = ("ray",)`` is checked with ``find_spec`` (nothing imported): without Ray the plugin is
*unavailable* and ``cluster: ray`` fails with ``pip install 'torchrig[ray]'``.
"""

from __future__ import annotations

from torchrig.plugin import HOOK_API_VERSION, PluginManifest


class RayManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = ("a Ray Train worker (ray.train.torch.TorchTrainer): ranks and world size from ray.train.get_context(), "
               "Ray's process group adopted; priority 60, before torchelastic (Ray exports RANK/LOCAL_RANK too)")
    requires = ("ray",)
    install_hint = "torchrig[ray]"
    priority = 60


__all__ = ["RayManifest"]
