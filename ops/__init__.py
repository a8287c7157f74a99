"""What an operator runs, and nothing the main job imports: stream admin (`streams`), status,
trace lookup, the audit, the chaos harness (`chaos`, `faults`, `chaos_monitor`), the Ray
launcher, a local NATS cluster (`cluster`), the GPU check (`gpu_check.py` and its sections in
`gpu/`) and the benchmarks (`bench/`)."""
