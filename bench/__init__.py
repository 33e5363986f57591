"""Benchmarks that drive the app as a user would (each a flat module: `python -m bench.NAME`)."""
