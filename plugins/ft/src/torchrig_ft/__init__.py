"""torchrig-ft: a first-party torchrig plugin distribution. See README.md beside pyproject.toml."""

__version__ = "0.1.0"
