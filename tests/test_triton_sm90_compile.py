"""KDA's intra-chunk Triton kernels compiled for SM90 on the CPU, in a fresh process without
``TRITON_INTERPRET``: the interpreter runs kernels as Python and misses what only the compiler
checks (a name rebound to another type inside an ``if``, for one), which would then fail on the
first GPU call. bf16 inputs (G from the gate pass, whole rows for the CuTe DSL state pass) and
float32 inputs (gates computed in the block kernels)."""
import os
import subprocess
import sys

import pytest

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cula_serve.kernels.delta_rule import chunk_triton as ct

POINTERS = dict(A_log="*fp32", dt_bias="*fp32", cu_seqlens="*i32", chunk_table="*i32", state_indices="*i32",
                N_ws="*fp32", Minv_ws="*fp32", T_ws="*fp16", G_ws="*fp32", Kd_ws="*fp16")
SCALARS = dict(lower_bound="fp32", scale="fp32")
KERNELS = {"_kda_gate_kernel": dict(BKG=ct.GATE_TILE), "_kda_block_kernel": dict(WHOLE_P=True),
           "_kda_exact_diag_kernel": {}, "_invert_kernel": dict(WHOLE=True)}


def compile_all(inputs, PREC_ACC, GATE_WS, warps):
    pointers = dict(POINTERS, q=inputs, k=inputs, g=inputs, beta=inputs, P_ws="*bf16", Qd_ws=inputs,
                    Ke_ws="*bf16")
    for name, extra in KERNELS.items():
        fn = getattr(ct, name)
        pointers["exact_marks"] = "*i8" if name == "_kda_block_kernel" else "*i32"
        constants = dict(HV=8, GROUP=2, K=128, BK=128, C=64, QK_L2NORM=True, FUSED_GATE=True, HAS_DT_BIAS=True,
                         SAFE_GATE=False, BETA_LOGITS=True, HAS_SLOTS=True, PREC_ACC=PREC_ACC,
                         FACTOR_SPAN=ct.FACTOR_SPAN, GATE_WS=GATE_WS, **extra)
        constants = {k: v for k, v in constants.items() if k in fn.arg_names}
        signature = {arg: "constexpr" if arg in constants else pointers.get(arg, SCALARS.get(arg, "i32"))
                     for arg in fn.arg_names}
        source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps[name], num_stages=1))


compile_all("*bf16", "tf32", True, dict(_kda_gate_kernel=2, _kda_block_kernel=2, _kda_exact_diag_kernel=4,
                                        _invert_kernel=2))
compile_all("*fp32", "tf32x3", False, dict(_kda_gate_kernel=2, _kda_block_kernel=4, _kda_exact_diag_kernel=4,
                                           _invert_kernel=2))
print("ok")
"""


def test_kda_intra_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
