"""Tests of torchrig.training: the step plan, accumulation, compile, conversion (and local_sgd)."""
