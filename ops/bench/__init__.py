"""Benchmarks: `python -m ops.bench.NAME [--quick]`; the last line printed is one JSON object."""
