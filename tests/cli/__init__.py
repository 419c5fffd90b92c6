"""Tests of torchrig.cli: the torchrig command."""
