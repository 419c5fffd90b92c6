"""The repository as a whole: lint, layers, test layout, docs, packaging, wheels, benchmarks harness."""
