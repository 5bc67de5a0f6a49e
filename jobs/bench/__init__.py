"""Benchmarks that print the figures in BENCHMARKS.md, each with the command that made it:
throughput (against HF static batching), kv (paged vs static allocation), prefix (the radix
cache and prefix ordering), cpu_attention (the C++ decode kernel), linears (the CPU
linear backends alone) and gpu (the Triton kernels).
Shared parts: workloads (the prompt sets), engine_runs (timed generate calls), ceiling (the
machine's matmul bound) and report (machine, command, tables, JSON)."""
