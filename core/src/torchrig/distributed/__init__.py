"""Where this process sits and how processes talk: process state (:mod:`.process`, Accelerate's
``PartialState``/``AcceleratorState``), the default process group's life (:mod:`.process_group`),
collectives over nested structures of tensors (:mod:`.collectives`, :mod:`.nested`) and the device a
device plugin answers with (:mod:`.device`).
"""
