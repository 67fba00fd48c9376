"""Benchmarks, each run as ``python -m bench.<name>``; each prints one JSON object as its
last line."""
