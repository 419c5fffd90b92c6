"""Tests of torchrig.tracking: the tracker hub, lanes, throughput."""
