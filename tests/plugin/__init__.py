"""Tests of torchrig.plugin: the hook contract and the plugin API."""
