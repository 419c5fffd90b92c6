"""``torchrig launch``: start a script on N processes through torch elastic, and name what failed.

Modules: :mod:`~torchrig.launch.cli` (flags, validation, the plan), :mod:`~torchrig.launch.worker`
(the per-rank wrapper), :mod:`~torchrig.launch.supervisor` (each rank's process tree dies with it),
:mod:`~torchrig.launch.status` (atomic status files; a rank records into its own through
:mod:`torchrig.resilience.run_status`),
:mod:`~torchrig.launch.summary` (the culprit and ``run_status.json``),
:mod:`~torchrig.launch.preflight` (ports and addresses), :mod:`~torchrig.launch.dryrun`.
The default ``torchrig_launch`` implementation is :mod:`torchrig.launch.elastic`.

Importing this package is cheap and torch-free: the wrapper imports it in every worker.
"""

from __future__ import annotations

from typing import Any


def main(argv: Any = None) -> int:
    # Imported when called: the wrapper imports this package in every worker, and must not pay for the CLI.
    from torchrig.launch.cli import main as _main

    return _main(argv)


__all__ = ["main"]
