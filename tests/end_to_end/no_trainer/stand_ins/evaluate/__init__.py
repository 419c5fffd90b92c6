"""A local stand-in for the ``evaluate`` package, for the no_trainer scripts run offline.

``evaluate.load("glue", "mrpc")`` / ``evaluate.load("accuracy")`` fetch metric scripts from the Hub, which these
machines cannot reach, so the test puts this directory first on ``PYTHONPATH`` instead: the scripts run unedited
and get a metric with evaluate's ``add_batch``/``compute`` interface. Only the metrics the tested scripts name are
provided; any other name is refused by name rather than computed wrongly.
"""

from __future__ import annotations

import math

__version__ = "0.0.0+torchrig-test-stand-in"


class Metric:
    """Accumulates predictions and references like ``evaluate.EvaluationModule``."""

    def __init__(self, name: str, config_name: str | None) -> None:
        self.name, self.config_name = name, config_name
        self._predictions: list = []
        self._references: list = []

    def add_batch(self, *, predictions=None, references=None) -> None:
        self._predictions.extend(_as_list(predictions))
        self._references.extend(_as_list(references))

    def add(self, *, prediction=None, reference=None) -> None:
        self._predictions.append(prediction)
        self._references.append(reference)

    def compute(self, *, predictions=None, references=None, **_: object) -> dict:
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        preds, refs = self._predictions, self._references
        self._predictions, self._references = [], []
        if len(preds) != len(refs):
            raise ValueError(f"{self.name}: {len(preds)} predictions for {len(refs)} references")
        result = {"accuracy": sum(p == r for p, r in zip(preds, refs)) / max(len(refs), 1), "samples": len(refs)}
        if self.name == "glue" and self.config_name in ("mrpc", "qqp"):
            tp = sum(p == 1 and r == 1 for p, r in zip(preds, refs))
            precision = tp / max(sum(p == 1 for p in preds), 1)
            recall = tp / max(sum(r == 1 for r in refs), 1)
            result["f1"] = 0.0 if tp == 0 else 2 * precision * recall / (precision + recall)
        if any(isinstance(v, float) and math.isnan(v) for v in result.values()):
            raise ValueError(f"{self.name}: NaN in {result}")
        return result


def _as_list(values) -> list:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)


SUPPORTED = {("accuracy", None), ("glue", "mrpc"), ("glue", "sst2"), ("glue", "rte"), ("glue", "qqp")}


def load(path: str, config_name: str | None = None, **_: object) -> Metric:
    if (path, config_name) not in SUPPORTED:
        raise ValueError(f"the offline evaluate stand-in has no metric {path!r} (config {config_name!r}); "
                         f"it provides {sorted(map(str, SUPPORTED))}: add it to tests/end_to_end/no_trainer/stand_ins/evaluate")
    return Metric(path, config_name)
