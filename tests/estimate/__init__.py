"""Tests of torchrig.estimate: memory estimates."""
