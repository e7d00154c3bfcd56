"""Benchmarks of hcp_compile, run as modules from the repository root, for example
``python -m benchmarks.plan_bench`` or
``torchrun --nproc-per-node 2 -m benchmarks.cp_throughput --ulysses 2 --ring 1``."""
