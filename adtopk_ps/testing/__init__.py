"""Harnesses the tests and benchmarks share: test hosts in network namespaces."""
