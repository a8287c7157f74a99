"""The sections of `python ops/gpu_check.py`, each run in a child process on a GPU machine:
engines, FSDP2, weights, and the optional serving engines (vLLM, SGLang)."""
