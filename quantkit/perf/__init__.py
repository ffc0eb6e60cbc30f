"""Speed and capacity, not accuracy: serving benchmarks (bench.py), kernel
micro-benchmarks (kernels.py) and memory/cost planning from a config (plan.py)."""
