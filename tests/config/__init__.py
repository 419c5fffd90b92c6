"""Tests of torchrig.config: typed sections, sources, precedence, validation."""
