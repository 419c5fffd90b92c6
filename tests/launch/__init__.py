"""Tests of torchrig.launch: the launcher, workers, notebook launcher, hand-off to clusters."""
