"""bench_serving: the benchmarks a serving engineer runs before trusting cula-serve.

Run from the repository root: ``python -m bench_serving kernels``.
"""
