"""Real SGLang objects on the CPU for the plugin tests: a published test configuration, a
``HybridReqToTokenPool`` with its ``MambaPool`` (speculative state included), the cula linear
backends built through SGLang's constructors, and ``ForwardBatch``es for extend, decode and target
verify. Imports SGLang: test modules call ``pytest.importorskip("sglang.srt.plugins")`` before
importing this.

The scheduler's part is played by writing the request-row -> mamba-slot mapping directly: request
row 0 maps to SGLang's reserved slot 0, which is what SGLang's eager padded rows carry.
"""
from __future__ import annotations

import types

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.linear.utils import LinearAttnBackends, LinearAttnKernelBackend
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.speculative.eagle_info import EagleVerifyInput

load_plugins()  # the real entry-point path: registers "cula" and applies its hooks

SHAPE = dict(H=2, HV=4, K=16, V=16)  # two value heads per qk head; square states for Lightning
LAYER_IDS = [1, 3]  # the linear layers; the test layer is 3 (pool index 1)
TEST_LAYER = 3
POOL_SIZE = 8  # mamba slots 1..8 usable, slot 0 reserved
DRAFT_TOKENS = 3
# request row -> mamba slot: row 0 is SGLang's padding row (slot 0), the rest permuted slots
ROW_SLOTS = {0: 0, 1: 5, 2: 2, 3: 7}
CONV_KERNEL = 4


def configuration(**fields):
    """Publish a test ``ServerArgs`` (SGLang's own test hook); returns the override to restore."""
    fields = {"attention_backend": "cula", "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": DRAFT_TOKENS, **fields}
    override = get_context().override_server_args(**fields)
    override.install()
    return override


def single_rank():
    """This process as the only attention tensor-parallel rank (Lightning reads its head slice)."""
    return get_parallel().override(attn_tp_rank=0)


def make_pool(state_dtype=torch.float32):
    H, HV, K, V = (SHAPE[x] for x in ("H", "HV", "K", "V"))
    conv_dim = 2 * H * K + HV * V
    shape = Mamba2StateShape(conv=[(conv_dim, CONV_KERNEL - 1)], temporal=(HV, V, K), intermediate_size=HV * V,
                             conv_dim=conv_dim, ssm_state_size=K, num_heads=HV, head_dim=V, state_size=K,
                             conv_kernel=CONV_KERNEL, num_k_heads_per_tp=H)
    params = Mamba2CacheParams(shape=shape, layers=LAYER_IDS,
                               dtype=Mamba2StateDType(conv=torch.float32, temporal=state_dtype))
    pool = HybridReqToTokenPool(size=POOL_SIZE, mamba_size=POOL_SIZE, mamba_spec_state_size=POOL_SIZE,
                                max_context_len=64, device="cpu", enable_memory_saver=False, cache_params=params,
                                mamba_layer_ids=LAYER_IDS, enable_mamba_extra_buffer=False,
                                speculative_num_draft_tokens=DRAFT_TOKENS, speculative_eagle_topk=1,
                                enable_overlap_schedule=False)
    mapping = pool.req_index_to_mamba_index_mapping
    for row, slot in ROW_SLOTS.items():
        mapping[row] = slot
    return pool


def make_runner(pool, server_args, hf_config=None):
    triton = LinearAttnKernelBackend.TRITON
    hf_config = hf_config or types.SimpleNamespace(num_attention_heads=SHAPE["HV"], num_hidden_layers=4)
    model_config = types.SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config, context_len=64)
    return types.SimpleNamespace(
        server_args=server_args, device="cpu", is_draft_worker=False, req_to_token_pool=pool, token_to_kv_pool=None,
        linear_attn_backends=LinearAttnBackends(decode=triton, prefill=triton, verify=triton),
        model_config=model_config, sliding_window_size=None, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        prefill_attention_backend_str="cula", decode_attention_backend_str="cula", use_mla_backend=False)


class FullAttentionUnderTest(AttentionBackend):
    """The full-attention side of the hybrid wrapper; these tests only run linear layers."""

    def __init__(self, pool):
        self.req_to_token_pool = pool
        self.token_to_kv_pool = None

    def init_forward_metadata(self, forward_batch):
        pass


def hybrid(linear_backend, pool):
    from cula_serve.integrations.sglang.backend import CulaHybridLinearAttnBackend

    return CulaHybridLinearAttnBackend(FullAttentionUnderTest(pool), linear_backend, [0, 2])


def layer(mode, generator):
    H, HV, K, V = (SHAPE[x] for x in ("H", "HV", "K", "V"))
    A_log = torch.empty(HV).uniform_(0, 2.5, generator=generator)
    dt_bias = torch.randn(HV if mode == "gdn" else HV * K, generator=generator)
    lower_bound = -5.0 if mode == "kda" else None
    return RadixLinearAttention(TEST_LAYER, H, H, HV, K, K, V, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)


def _batch(mode, rows, num_tokens, **fields):
    bs = len(rows)
    seq_lens = torch.full((bs,), 9)
    return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.zeros(num_tokens, dtype=torch.int64),
                        req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=seq_lens,
                        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64), seq_lens_sum=int(seq_lens.sum()),
                        seq_lens_cpu=seq_lens.clone(), **fields)


def extend_batch(rows, lens, prefix_lens):
    i32 = torch.int32
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return _batch(ForwardMode.EXTEND, rows, sum(lens), extend_seq_lens=torch.tensor(lens, dtype=i32),
                  extend_start_loc=torch.tensor(starts, dtype=i32), extend_prefix_lens=torch.tensor(prefix_lens, dtype=i32),
                  extend_seq_lens_cpu=list(lens), extend_prefix_lens_cpu=list(prefix_lens), extend_num_tokens=sum(lens))


def decode_batch(rows):
    return _batch(ForwardMode.DECODE, rows, len(rows))


def verify_batch(rows):
    bs, T = len(rows), DRAFT_TOKENS
    z = torch.zeros(bs * T, dtype=torch.int64)
    spec = EagleVerifyInput(draft_token=z, custom_mask=None, positions=z, retrieve_index=z.view(bs, T),
                            retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
                            spec_steps=T - 1, topk=1, draft_token_num=T, capture_hidden_mode=CaptureHiddenMode.FULL,
                            seq_lens_sum=9 * bs, seq_lens_cpu=torch.full((bs,), 9))
    return _batch(ForwardMode.TARGET_VERIFY, rows, bs * T, spec_info=spec)
