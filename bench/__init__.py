"""Benchmarks behind ``pdserve bench``; clients of the public APIs only."""
