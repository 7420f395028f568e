"""bench_serving: the benchmarks a serving engineer runs before trusting cula-serve.

Run from the repository root: ``python -m bench_serving kernels``.

The "fla" rows are FLA's own kernels. FLA 0.6.0 hands ``chunk_gated_delta_rule`` to FlashQLA
whenever ``flash_qla`` is importable (its backend dispatch, decided when ``fla.ops`` is imported),
which would make them FlashQLA's numbers twice; so dispatch is off unless the caller set
``FLA_DISABLE_BACKEND_DISPATCH`` already. FlashQLA has its own rows (``--peers flashqla``).
"""
import os

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
