"""Operator tools: stream admin, status, traces, launchers, benchmarks."""
