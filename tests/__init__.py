"""The core's tests, one folder per package of core/src/torchrig (CONTRIBUTING.md, "A test")."""
