"""Tests of torchrig.resilience: preemption, run status, liveness."""
