"""Tests of torchrig.builtins: built-in devices, precisions, the single strategy, cluster environments."""
