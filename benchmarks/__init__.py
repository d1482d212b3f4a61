"""Speed benchmarks (not part of the test suite): python -m benchmarks.throughput."""
