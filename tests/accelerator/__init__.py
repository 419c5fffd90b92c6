"""Tests of torchrig.accelerator: the Accelerator and its per-concern parts."""
