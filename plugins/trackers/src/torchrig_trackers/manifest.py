"""Manifests of the tracker plugins: what torchrig knows about each without importing it.

Loaded for every run, ``torchrig plugins`` and ``torchrig launch --help``; torch-free and free of
the trackers' libraries. ``requires`` names the library each runtime needs (checked with
``find_spec``, nothing imported): without it the tracker is *unavailable* and selecting it
fails with ``install_hint`` — ``pip install 'torchrig[wandb]'``.
"""

from __future__ import annotations

from torchrig.plugin import HOOK_API_VERSION, PluginManifest


class CSVManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "CSV files: <logging_dir>/<project>/metrics.csv (time, step, name, value) and hparams.csv; no dependency"
    install_hint = "torchrig[trackers]"


class JSONLManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "JSON lines: <logging_dir>/<project>/metrics.jsonl (start, config, log, finish events); no dependency"
    install_hint = "torchrig[trackers]"


class TensorBoardManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "TensorBoard event files in <logging_dir>/<project> (scalars, text, histograms, images, hparams)"
    requires = ("tensorboard",)
    install_hint = "torchrig[tensorboard]"
    exports = {"TensorBoardTracker": "torchrig_trackers.tensorboard_tracker:TensorBoardTracker"}


class WandBManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "Weights & Biases: one run per job (WANDB_MODE=offline works), config, metrics, images, tables"
    requires = ("wandb",)
    install_hint = "torchrig[wandb]"
    exports = {"WandBTracker": "torchrig_trackers.wandb_tracker:WandBTracker"}


class MLflowManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "MLflow: one run in experiment <project>, params and metrics (default store: <logging_dir>/mlflow.db)"
    requires = ("mlflow",)
    install_hint = "torchrig[mlflow]"
    exports = {"MLflowTracker": "torchrig_trackers.mlflow_tracker:MLflowTracker"}


__all__ = ["CSVManifest", "JSONLManifest", "MLflowManifest", "TensorBoardManifest", "WandBManifest"]
