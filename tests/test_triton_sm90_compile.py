"""Every Triton kernel that the triton backend launches, compiled for SM90 on the CPU: the
interpreter runs kernels as Python and misses what only the compiler checks (a name rebound to
another type inside an ``if``, for one), which would then fail on the first GPU call.

A fresh process without ``TRITON_INTERPRET`` runs the Level-1 API on CPU tensors with the
launches recorded instead of run (prefill of GDN, KDA and Lightning with bf16 and float32
inputs, checkpoints and segments; the exact diagonal blocks that the cute backend's KDA
intra-chunk kernel marks, and the Triton launches of its segments' join; decode; verify in the
three protocols, with a pending commit, and commit), then compiles each distinct launch (about
80, 85 s on one core) for sm_90 with its arguments' types, constexprs, options and the JIT's
divisibility hints (pointers 16-byte aligned, integers that are multiples of 16).

The tensor-core verifies (``verify_wy_triton``, ``verify_chunk_triton``) are held to one more
thing there: no state tile staged in unswizzled shared memory and read into the tensor cores'
layout (8-way bank conflicts: KDA's commit took about 61 us so against 50 once its tile was a
product's accumulator first, H200, B = 64)."""
import os
import subprocess
import sys

import pytest

_COMPILE = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from cula_serve import cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify
from cula_serve.api import _recipe
from cula_serve.inputs import random_inputs
from cula_serve.kernels.backends import triton_backend
from cula_serve.kernels.common.varlen import chunk_indices
from cula_serve.kernels.delta_rule.chunk_triton import kda_exact_diagonal

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
launches = {}


def record(fn, *args, grid, warmup, **kwargs):
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    key = (fn.fn.__name__, repr(signature), repr(sorted(constexprs.items())), repr(sorted(options.items())))
    launches.setdefault(key, (fn, signature, constexprs, options, attrs))


JITFunction.run = record
triton_backend.availability = lambda device: None  # compiled here, never run
TRITON = dict(backend="triton")
shape = dict(H=4, HV=8, K=128, V=128)
generator = torch.Generator().manual_seed(0)
lens = [200, 1, 70]
cu_seqlens = torch.tensor([0, 200, 201, 271], dtype=torch.int32)
slots = torch.tensor([2, -1, 0], dtype=torch.int32)

for mode, prefill in (("gdn", cula_gdn), ("kda", cula_kda), ("lightning", cula_lightning)):
    for dtype, state_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        kw = random_inputs(mode, (sum(lens),), **shape, dtype=dtype, generator=generator)
        pool = torch.zeros(4, 8, 128, 128, dtype=state_dtype)
        call = dict(kw, cu_seqlens=cu_seqlens, state_pool=pool, state_indices=slots, **TRITON)
        prefill(**call)
        prefill(**call, checkpoint_every=64, checkpoint_indices=torch.full((3, 4), -1, dtype=torch.int32))
        prefill(**call, segment_tokens=64)
    for state_dtype in (torch.float32, torch.bfloat16):
        pool = torch.zeros(4, 8, 128, 128, dtype=state_dtype)
        kw = random_inputs(mode, (3, 1), **shape, generator=generator)
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        cula_decode(q, k, v, pool, mode=mode, state_indices=slots, **kw, **TRITON)
        kw = random_inputs(mode, (3, 4), **shape, generator=generator)
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        accepted = torch.tensor([2, 0, 4], dtype=torch.int32)
        _, pending = cula_verify(q, k, v, pool, mode=mode, protocol="deferred", state_indices=slots, **kw, **TRITON)
        cula_commit(pending, accepted)
        _, pending = cula_verify(q, k, v, pool, mode=mode, protocol="deferred", state_indices=slots, **kw, **TRITON)
        cula_verify(q, k, v, pool, mode=mode, state_indices=slots, pending=pending, num_accepted_tokens=accepted,
                    **kw, **TRITON)
        buffer = torch.zeros(3, 4, 8, 128, 128, dtype=state_dtype)
        _, pending = cula_verify(q, k, v, pool, mode=mode, protocol="buffer", state_indices=slots,
                                 intermediate_states=buffer, intermediate_indices=torch.arange(3, dtype=torch.int32),
                                 **kw, **TRITON)
        cula_commit(pending, accepted)
        columns = torch.tensor([[2, 3, -1, -1], [-1] * 4, [0, 1, -1, -1]], dtype=torch.int32)
        _, pending = cula_verify(q, k, v, pool, mode=mode, protocol="slots", state_indices=columns,
                                 num_accepted_tokens=torch.tensor([1, 1, 2], dtype=torch.int32), **kw, **TRITON)
        cula_commit(pending, accepted.clamp(min=1))

# the exact diagonal blocks the cute backend's KDA intra-chunk kernel marks (gates summed from g)
kw = random_inputs("kda", (sum(lens),), **shape, generator=generator)
recipe, g, beta = _recipe("kda", (sum(lens),), 8, 128, device=kw["q"].device, g=kw["g"], beta=kw["beta"], decay=None,
                          scale=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=kw["A_log"],
                          dt_bias=kw["dt_bias"], lower_bound=None, use_beta_sigmoid_in_kernel=True)
table = chunk_indices(cu_seqlens, sum(lens), 64)
kda_exact_diagonal(recipe, kw["q"], kw["k"], g, beta, cu_seqlens, table, slots,
                   torch.zeros(sum(lens), 8, 64, dtype=torch.bfloat16), torch.zeros(sum(lens), 8, 64),
                   torch.ones(table.shape[0] * 8, 4, dtype=torch.int8))

# the Triton launches of the cute backend's one-pass segments' join: one (two segments), then two
from cula_serve.kernels.common.affine_output import join_segments
for tokens, pool_dtype in ((192, torch.float32), (192, torch.bfloat16), (64, torch.float32), (8192, torch.bfloat16)):
    transitions = torch.zeros(8, 8, 256, 128)
    join_segments(cu_seqlens, slots, transitions, torch.zeros(271, 8, 128, dtype=torch.bfloat16),
                  torch.zeros(271, 8, 128, dtype=torch.bfloat16), torch.zeros(4, 8, 128, 128, dtype=pool_dtype),
                  tokens=tokens)

target = GPUTarget("cuda", 90, 32)
for fn, signature, constexprs, options, attrs in launches.values():
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=target,
                                  options=options)
    except Exception as err:
        raise SystemExit(f"{fn.fn.__name__} {signature} {constexprs} {options}: {err}")
    if fn.fn.__name__ in ("_wy_kernel", "_lightning_chunk_kernel"):
        lines = compiled.asm["ttgir"].splitlines()
        unswizzled = [line.split(" = ")[0] for line in lines
                      if line.startswith("#shared") and "<{vec = 1, perPhase = 1, maxPhase = 1," in line]
        for encoding in unswizzled:
            conflicted = [line.strip() for line in lines
                          if "ttg.local_load" in line and f"{encoding}," in line and "#mma>" in line]
            if conflicted:
                names = {fn.params[i].name: value for (i,), value in constexprs.items() if value is not None}
                raise SystemExit(f"{fn.fn.__name__} {names} {signature.get('pool')} {options}: unswizzled "
                                 f"tile read into the tensor cores' layout: {conflicted[0][:300]}")
print(len(launches), "launches compiled")
print("ok")
"""


def test_every_triton_launch_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout + result.stderr)[-3000:]
