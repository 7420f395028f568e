"""Sources for a fresh process that compiles a CuTe DSL prefill for SM90 on the CPU (the DSL reads
its target at import): a model-shaped call's dtypes and compile-time arguments, then ``launch``.
Both need SEGMENTED set before they run."""

GDN_PREFILL = """
import torch
from cula_serve.kernels.common import cute_prefill
from cula_serve.kernels.delta_rule import chunk_cute, recurrent_cute

f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
H, HV, D = 16, 32, 128
dtypes = (bf16, bf16, bf16, bf16, f32, f32, f32, f32, f32, i32, i32, torch.bool, i32, f32, bf16)
constexprs = (("STRIDES", (H * D, D, H * D, D, HV * D, D, HV * D, D, HV * D * D, D * D)),
              ("GATE_STRIDES", (HV, 1, HV, 1)), ("H", H), ("HV", HV), ("QK_L2NORM", True),
              ("GATE", recurrent_cute.GATE_SOFTPLUS), ("HAS_DT_BIAS", True), ("BETA_LOGITS", True),
              ("HAS_SLOTS", True), ("HAS_POOL", True), ("HAS_INIT_FLAGS", True), ("HAS_CKPT", False),
              ("SEGMENTED", SEGMENTED))
launch = cute_prefill._compiled(chunk_cute._launch, chunk_cute._POINTERS, dtypes, constexprs, 1)
"""

KDA_PREFILL = """
import torch
from cula_serve.kernels.common import cute_prefill
from cula_serve.kernels.delta_rule import chunk_cute

f32, f16, bf16, i32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
HV, D = 32, 128
# Qd, Ke, Kd, P, T, v, out, pool, G, beta, cu_seqlens, state_indices, has_initial_state, checkpoints,
# transitions, q_carried
dtypes = (bf16, bf16, f16, bf16, f16, bf16, bf16, f32, f32, f32, i32, i32, torch.bool, i32, f32, bf16)
constexprs = (("STRIDES", (HV * D, D, HV * D, D, HV * D, D, HV * D, D, HV * D * D, D * D)), ("HV", HV),
              ("HAS_SLOTS", True), ("HAS_POOL", True), ("HAS_INIT_FLAGS", True), ("HAS_CKPT", False),
              ("BETA_STRIDES", (HV, 1)), ("BETA_LOGITS", True), ("SEGMENTED", SEGMENTED))
launch = cute_prefill._compiled(chunk_cute._kda_launch, chunk_cute._KDA_POINTERS, dtypes, constexprs, 1)
"""

KDA_INTRA = """
import torch
from cula_serve.kernels.common import cute_prefill
from cula_serve.kernels.delta_rule import intra_cute, recurrent_cute

f32, f16, bf16, i32, i8 = torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8
H, HV, D = 32, 32, 128
# q, k, g, beta, A_log, dt_bias, cu_seqlens, table, state_indices, P, N, Qd, Ke, Kd, G, marks
dtypes = (bf16, bf16, f32, f32, f32, f32, i32, i32, i32, bf16, f32, bf16, bf16, f16, f32, i8)
constexprs = (("STRIDES", ((H * D, D, 1), (H * D, D, 1), (HV * D, D, 1), (HV, 1))), ("H", H), ("HV", HV),
              ("QK_L2NORM", True), ("GATE", recurrent_cute.GATE_SOFTPLUS), ("HAS_DT_BIAS", True),
              ("LOWER_BOUND", 0.0), ("BETA_LOGITS", True), ("HAS_SLOTS", True))
launch = cute_prefill._compiled(intra_cute._launch, intra_cute._POINTERS, dtypes, constexprs, 1)
"""
