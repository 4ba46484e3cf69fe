"""Benchmark harness behind `specserve bench`."""
