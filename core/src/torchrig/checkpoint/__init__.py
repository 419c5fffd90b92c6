"""Checkpoints that survive ``kill -9``: the commit protocol, what is saved, and weights export.

* :mod:`~torchrig.checkpoint.files` — durable files and the writer strategies write through;
* :mod:`~torchrig.checkpoint.layout` — temporary siblings, manifests, ``latest``, rotation;
* :mod:`~torchrig.checkpoint.state` — RNG and the run fingerprint;
* :mod:`~torchrig.checkpoint.manager` — ``save_state`` / ``load_state`` (sync and async);
* :mod:`~torchrig.checkpoint.export` — ``save_model`` and ``save``;
* :mod:`~torchrig.checkpoint.faults` — named kill points for tests.

See docs/checkpoints.md for the layout, the protocol and its guarantees.
"""

from torchrig.checkpoint.files import CheckpointError, CheckpointWriter, FileRecord
from torchrig.checkpoint.layout import MANIFEST_NAME, latest_checkpoint, read_manifest

__all__ = ["MANIFEST_NAME", "CheckpointError", "CheckpointWriter", "FileRecord", "latest_checkpoint", "read_manifest"]
