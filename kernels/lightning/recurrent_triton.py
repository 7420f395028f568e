"""Lightning attention token by token in Triton: decode, MTP verify (three protocols) and commit.

Per value head ``hv`` (qk head ``hv // (HV // H)``) with the constant log decay ``d_hv <= 0``, in
float32 (``naive.py`` is the oracle):

    S = exp(d_hv) S + k_t v_t^T;   o_t = scale * S^T q_t          (q, k optionally l2-normalised)

Grid, tiling, pool layout and the meaning of ``op`` are those of the delta-rule kernel
(``kernels/delta_rule/recurrent_triton.py``, whose pool-protocol helpers this kernel uses): one
program per (sequence, value head, V-tile) holds its K x BV slice of the state in registers for
all T tokens, so the state is read once and written once per call. Deferred verifies and commits
with 16-bit inputs run as products on the tensor cores instead (``verify_chunk_triton.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import verify_chunk_triton
from ..common.pool_protocol import output_target, strides3, unit_last
from ..delta_rule.recurrent_triton import (OP_COMMIT, block_v, device_guard, head_and_tile, load_buffer_row,
                                           load_head_vector, load_state, protocol_args, read_slot, rows_dot,
                                           state_tile, store_final_state, store_token_state, tile_rows,
                                           tile_split, tokens_to_run)


@triton.jit
def _lightning_recurrent_kernel(
    q, k, v, decay, o,
    stride_q_n, stride_q_t, stride_q_h,
    stride_k_n, stride_k_t, stride_k_h,
    stride_v_n, stride_v_t, stride_v_h,
    stride_o_n, stride_o_t, stride_o_h,
    scale,
    pool, buffer, state_indices, num_accepted, buffer_rows,
    stride_pool, stride_buf_r, stride_buf_t, stride_idx_n, stride_idx_t, num_columns,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    LV: tl.constexpr, KL: tl.constexpr, NORM_ON_ROWS: tl.constexpr, OP: tl.constexpr, QK_L2NORM: tl.constexpr,
):
    i_nh, i_v = head_and_tile(V, BV)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    offs_v = tile_rows(i_v, BV, LV)

    slot = read_slot(state_indices, num_accepted, i_n, stride_idx_n, stride_idx_t, num_columns, OP)
    live = slot >= 0
    count = tokens_to_run(num_accepted, i_n, live, T, OP)
    tile = state_tile(i_hv, i_v, K, V, BV, LV, KL)
    h = load_state(pool, slot, stride_pool, tile, live)  # h[lv, r, c, j] = S[c KL + j, offs_v[lv, r]]
    buffer_row = load_buffer_row(buffer_rows, i_n, OP)
    head_decay = tl.exp(tl.load(decay + i_hv).to(tl.float32))

    i_n64 = i_n.to(tl.int64)
    for t in range(T):
        active = t < count
        k_t, k_norm = load_head_vector(k, i_n64 * stride_k_n + t * stride_k_t + i_h * stride_k_h, active,
                                       1.0, K, LV, KL, QK_L2NORM, NORM_ON_ROWS)
        b_v = tl.load(v + i_n64 * stride_v_n + t * stride_v_t + i_hv * stride_v_h + offs_v,
                      mask=active, other=0.0).to(tl.float32)
        # an inactive token (past a commit's accepted count) leaves the state bit-identical:
        # h * 1 + 0 with k = v = 0
        h = h * tl.where(active, head_decay, 1.0) + (b_v * k_norm)[:, :, None, None] * k_t
        if OP != OP_COMMIT:
            # padding rows have h = 0 and q = 0, so their output is exactly zero
            q_t, q_norm = load_head_vector(q, i_n64 * stride_q_n + t * stride_q_t + i_h * stride_q_h, active,
                                           scale, K, LV, KL, QK_L2NORM, NORM_ON_ROWS)
            b_o = rows_dot(h, q_t) * q_norm
            tl.store(o + i_n64 * stride_o_n + t * stride_o_t + i_hv * stride_o_h + offs_v,
                     b_o.to(o.dtype.element_ty))
        store_token_state(h, t, i_n, live, pool, buffer, state_indices, buffer_row, tile,
                          stride_pool, stride_buf_r, stride_buf_t, stride_idx_n, stride_idx_t, OP)

    store_final_state(h, pool, slot, stride_pool, tile, count, OP)


def lightning_recurrent(recipe, q, k, v, decay, *, op, state_pool, state_indices, out=None,
                        num_accepted_tokens=None, intermediate_states=None, intermediate_indices=None):
    """Run Lightning attention over T tokens of N sequences against the state pool.

    Args:
        recipe: the call's ``Recipe`` (mode "lightning"; qk l2norm and scale are used).
        q, k: [N, T, H, K] bf16 / fp16 / fp32, any strides (q is None for op="commit").
        v: [N, T, HV, V], q's dtype, HV a multiple of H.
        decay: [HV] log decay per value head (<= 0), float32 (bf16 accepted).
        op, state_pool, state_indices, out, num_accepted_tokens, intermediate_states,
        intermediate_indices: as for ``delta_rule_recurrent``.
    """
    N, T, HV, V = v.shape
    H, K = k.shape[-2:]
    kernel_args = protocol_args(op, state_pool=state_pool, state_indices=state_indices,
                                num_accepted_tokens=num_accepted_tokens, intermediate_states=intermediate_states,
                                intermediate_indices=intermediate_indices, T=T)
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    target = output_target(out)
    if verify_chunk_triton.applies(op, state_pool, T, K, V, k.dtype):
        with device_guard(v.device):
            verify_chunk_triton.lightning_chunk(recipe, q, k, v, decay.contiguous(), op=op, state_pool=state_pool,
                                                state_indices=state_indices, out=target,
                                                num_accepted_tokens=num_accepted_tokens)
        if target is not out:
            out.copy_(target)
        return out
    bv, num_warps = block_v(N, HV, K, V, v.device, op, "lightning")
    with device_guard(v.device):
        _lightning_recurrent_kernel[(N * HV * (V // bv),)](
            q, k, v, decay.contiguous(), target,
            *strides3(q), *strides3(k), *strides3(v), *strides3(target),
            T=T, scale=recipe.scale, H=H, HV=HV, K=K, V=V, BV=bv, QK_L2NORM=recipe.qk_l2norm,
            **tile_split(K, bv, False, op),
            num_warps=num_warps, **kernel_args,
        )
    if target is not out:
        out.copy_(target)
    return out
