"""Benchmarks run on real hardware (`ds4 bench ...`)."""
