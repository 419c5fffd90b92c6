"""torchrig-localsgd: an example third-party torchrig plugin (strategy ``localsgd``). See README.md."""

__version__ = "0.1.0"
