"""The version of torchrig; every first-party plugin distribution moves in lockstep with it."""

__version__ = "0.1.0"
