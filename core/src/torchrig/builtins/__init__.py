"""The core's built-in plugins: the ``single`` strategy, precisions ``no``/``fp16``/``bf16`` and
devices ``cpu``/``cuda``/``mps``. They are declared as entry points in the core's
``pyproject.toml`` and discovered, listed and selected exactly like third-party plugins."""
