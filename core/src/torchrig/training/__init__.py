"""What a training step is made of, decided once at ``prepare``: the step plan (:mod:`.step_plan`), the
accumulation and data-position state (:mod:`.gradient_state`), what happens to a model before a strategy
wraps it (:mod:`.conversion`, :mod:`.meta_device`), ``torch.compile`` and the proof it took effect
(:mod:`.compile`, :mod:`.compile_check`), and the check that trained parameters were prepared
(:mod:`.unprepared`).
"""
