"""Tests of torchrig.host: plugin discovery, the plugin host, run assembly."""
