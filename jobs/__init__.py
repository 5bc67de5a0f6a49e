"""Ready-made pipelines on top of batchpage, run from the repository root as modules:
`python -m jobs.nightly_eval`, `python -m jobs.synthetic_data`, `python -m jobs.quickstart`, and
the benchmarks under jobs/bench/ (`python -m jobs.bench.peers`, `python -m jobs.bench.ab`)."""
