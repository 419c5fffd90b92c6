"""Tests of torchrig.testing: the test kit itself."""
