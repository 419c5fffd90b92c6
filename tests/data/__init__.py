"""Tests of torchrig.data: prepared data loaders."""
