"""torchrig-fp8: the ``fp8`` precision plugin on torchao. See README.md beside pyproject.toml.

Importing this package imports neither torch nor torchao; :func:`conversion_report` (what the
conversion did to a model) lives in :mod:`torchrig_fp8.convert`.
"""

__version__ = "0.1.0"
