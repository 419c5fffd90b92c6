"""Tests of torchrig.distributed: processes, process groups, collectives, devices."""
