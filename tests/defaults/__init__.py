"""Tests of torchrig.defaults: the core's default hook implementations."""
