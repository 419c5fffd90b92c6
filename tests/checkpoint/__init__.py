"""Tests of torchrig.checkpoint: the commit protocol, manifests, loading, HF weights."""
