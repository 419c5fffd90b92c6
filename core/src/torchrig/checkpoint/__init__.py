"""Checkpoints that survive ``kill -9``: the commit protocol, what is saved, and weights export.

* :mod:`~torchrig.checkpoint.files` — durable files and the writer strategies write through;
* :mod:`~torchrig.checkpoint.layout` — committed and damaged checkpoints, ``latest``, rotation;
* :mod:`~torchrig.checkpoint.manifest` — manifests: validated fields, confined files, verification;
* :mod:`~torchrig.checkpoint.temporaries` — hidden working directories, owned and reclaimed only
  from dead writers;
* :mod:`~torchrig.checkpoint.trust` — loading without unpickling code, saving only what loads;
* :mod:`~torchrig.checkpoint.state` — RNG and the run fingerprint;
* :mod:`~torchrig.checkpoint.state_dicts` — plain state dicts and registered objects on disk
  (safetensors + a JSON skeleton, no pickle);
* :mod:`~torchrig.checkpoint.plain` — reading that plain state, for strategies that distribute it;
* :mod:`~torchrig.checkpoint.safetensors_header` — a safetensors header checked by the library's rules;
* :mod:`~torchrig.checkpoint.direct_read` — safetensors read straight into live tensors;
* :mod:`~torchrig.checkpoint.topology` — the layout (mesh) a checkpoint was saved under;
* :mod:`~torchrig.checkpoint.ledger` — what a run checkpoints (appended to by the Accelerator);
* :mod:`~torchrig.checkpoint.manager` — ``save_state`` (sync and async);
* :mod:`~torchrig.checkpoint.loading` — ``load_state``;
* :mod:`~torchrig.checkpoint.pending` — asynchronous saves still running when the script ends;
* :mod:`~torchrig.checkpoint.export` — ``save_model`` and ``save``;
* :mod:`~torchrig.checkpoint.faults` — named kill points for tests.

See docs/checkpoints.md for the layout, the protocol and its guarantees.
"""

from torchrig.checkpoint.files import CheckpointError, CheckpointWriter, FileRecord
from torchrig.checkpoint.layout import MANIFEST_NAME, latest_checkpoint, read_manifest

__all__ = ["MANIFEST_NAME", "CheckpointError", "CheckpointWriter", "FileRecord", "latest_checkpoint", "read_manifest"]
