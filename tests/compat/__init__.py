"""Tests of torchrig.compat: Accelerate's names, module paths, flags; the 0.1 paths kept for a release."""
