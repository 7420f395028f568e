"""vLLM's GDN and KDA layers with the cula plugin, against the float64 oracle, on the CPU.

Each test builds a tiny model config with ``--attention-backend cula``, constructs vLLM's layer
(the plugin swaps in its class), binds NaN-filled state pages laid out as vLLM lays them out,
and drives a sequence of batches through it: each batch's metadata comes from the layer
backend's metadata builder (vLLM's GDN builder and the plugin's subclass) given vLLM's
``CommonAttentionMetadata``, and the layer runs as vLLM runs it (the GDN layer through vLLM's
custom op ``vllm::qwen_gdn_attention_core``). Batches cover prefill, mixed decode + prefill,
decode-only with CUDA-graph padding rows, speculative verify (uniform, ragged, mixed with a
prefill) with ``num_accepted_tokens`` from the previous step, and prefix-caching checkpoints.

The oracle replays each request's accepted tokens from scratch in float64: the causal
convolution written out here, then cula-serve's float64 recurrence (tests/conftest.py ORACLE).
Outputs and every state vLLM would read next are compared with DESIGN section 7's tolerances;
blocks no request owns (the null block 0 among them) must stay NaN.
"""
import pytest
import torch

pytest.importorskip("vllm.version", reason="needs the vllm package (.ci/vllm.sh installs it)")

import vllm_harness as harness  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402

from conftest import ORACLE, assert_close, tolerance  # noqa: E402
from cula_serve import cula_gdn, cula_kda  # noqa: E402
from cula_serve.integrations.vllm.plugin import register  # noqa: E402

register()

PREFIX = "model.layers.0.linear_attn"
GDN_SHAPE = dict(H=2, HV=4, K=16, V=8)
KDA_SHAPE = dict(H=2, D=16)
WIDTH = 4


class PassThroughNorm(torch.nn.Module):
    """Stands in for the KDA layer's output norm, so the test sees cula-serve's output."""

    def forward(self, x, gate):
        return x


# A request's tokens are the float64 inputs (mixed_qkv, gate, beta) of each token.
Request = harness.Request


class LayerCase:
    """A bound layer, its metadata builder and the oracle for one family ("gdn" or "kda")."""

    def __init__(self, mode, tmp_path, generator, *, num_spec=0, prefix_caching=False, full_cuda_graph=False,
                 num_blocks=24, lower_bound=None, ssm_dtype=None):
        self.mode, self.generator = mode, generator
        if mode == "gdn":
            folder = harness.save_qwen3_next(tmp_path, **GDN_SHAPE, conv_width=WIDTH)
            layer_cls = QwenGatedDeltaNetAttention
        else:
            folder = harness.save_kimi_linear(tmp_path, **KDA_SHAPE, conv_width=WIDTH, lower_bound=lower_bound)
            layer_cls = KimiGatedDeltaNetAttention
        self.config = harness.make_vllm_config(folder, num_spec=num_spec, prefix_caching=prefix_caching,
                                               full_cuda_graph=full_cuda_graph, ssm_dtype=ssm_dtype)
        self.bound = harness.build_layer(layer_cls, self.config, PREFIX, num_blocks, generator)
        self.layer = self.bound.layer
        if mode == "kda":
            self.layer.o_norm = PassThroughNorm()
        self.builder = harness.metadata_builder(self.bound, PREFIX)
        if mode == "gdn":
            H, HV, K, V = (GDN_SHAPE[x] for x in ("H", "HV", "K", "V"))
        else:
            H = HV = KDA_SHAPE["H"]
            K = V = KDA_SHAPE["D"]
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.dim = 2 * H * K + HV * V
        self.dtype = self.config.model_config.dtype
        self.owned = set()

    # -- inputs ------------------------------------------------------------------------------

    def tokens(self, n):
        """Raw inputs of n tokens in float64: (mixed_qkv [n, dim], gate, beta)."""
        g = self.generator
        x = torch.randn(n, self.dim, generator=g, dtype=torch.float64)
        gate_shape = (n, self.HV) if self.mode == "gdn" else (n, self.HV, self.K)
        return [(x[i], torch.randn(gate_shape[1:], generator=g, dtype=torch.float64),
                 torch.randn(self.HV, generator=g, dtype=torch.float64)) for i in range(n)]

    def run(self, rows, *, draft_tokens=None, accepted=None, num_tokens=None):
        """Run one batch. rows: (request, new tokens, is_prefilling) in batch order, padding rows as
        None. Returns the layer output [tokens, HV, V] (float64)."""
        batch_tokens = []
        for row in rows:
            if row is not None:
                self.owned.update(row[0].blocks)
                batch_tokens += row[1]
        common, md = harness.build_batch(self.builder, rows, draft_tokens=draft_tokens, accepted=accepted,
                                         num_tokens=num_tokens)
        T = common.num_actual_tokens
        pad = T - len(batch_tokens)
        x = torch.stack([t[0] for t in batch_tokens] + [torch.zeros(self.dim, dtype=torch.float64)] * pad)
        gate = torch.stack([t[1] for t in batch_tokens] + [torch.zeros_like(batch_tokens[0][1])] * pad)
        beta = torch.stack([t[2] for t in batch_tokens] + [torch.zeros(self.HV, dtype=torch.float64)] * pad)
        x, gate, beta = (t.to(self.dtype) for t in (x, gate, beta))
        with torch.no_grad(), set_forward_context({PREFIX: md}, self.config):
            if self.mode == "gdn":
                out = torch.zeros(T, self.HV, self.V, dtype=self.dtype)
                torch.ops.vllm.qwen_gdn_attention_core(x, beta, gate, out, PREFIX)
            else:
                out = torch.zeros(1, T, self.HV, self.V, dtype=self.dtype)
                g2 = torch.zeros(T, self.HV, self.V, dtype=self.dtype)
                self.layer._forward(x, gate[None], g2, beta[None], out)
                out = out[0]
        return md, out.double()

    # -- the oracle --------------------------------------------------------------------------

    def oracle(self, tokens):
        """Outputs [n, HV, V] and final state [HV, V, K] of a request's tokens from scratch."""
        x = torch.stack([t[0] for t in tokens]).to(self.dtype).double()
        gate = torch.stack([t[1] for t in tokens]).to(self.dtype).double()
        beta = torch.stack([t[2] for t in tokens]).to(self.dtype).double()
        weight = self.layer.conv1d.weight.detach().double().view(self.dim, WIDTH)
        padded = torch.cat([torch.zeros(WIDTH - 1, self.dim, dtype=torch.float64), x])
        conv = sum(padded[j: j + len(tokens)] * weight[:, j] for j in range(WIDTH))
        conv = torch.nn.functional.silu(conv)
        key = self.H * self.K
        q = conv[:, :key].view(1, -1, self.H, self.K)
        k = conv[:, key: 2 * key].view(1, -1, self.H, self.K)
        v = conv[:, 2 * key:].view(1, -1, self.HV, self.V)
        prefill = cula_gdn if self.mode == "gdn" else cula_kda
        extra = {} if self.mode == "gdn" else dict(lower_bound=self.layer.gate_lower_bound)
        o, final = prefill(q, k, v, gate[None], beta[None], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=self.layer.A_log.detach().double(), dt_bias=self.layer.dt_bias.detach().double(),
                           use_beta_sigmoid_in_kernel=True, output_final_state=True, **extra, **ORACLE)
        return o[0], final[0]

    def tol(self):
        return tolerance(self.dtype, self.bound.ssm_state.dtype)

    def check_outputs(self, out, rows, first_token=0):
        """Outputs of the batch's rows against the oracle (rows as in ``run``; spec rows use the
        request's committed tokens plus the new ones)."""
        harness.check_row_outputs(out, rows, self.oracle, self.tol(), first_token)

    def check_state(self, block, tokens, what):
        _, final = self.oracle(tokens)
        assert_close(self.bound.ssm_state[block].double(), final, self.tol(), what)

    def check_untouched(self, num_blocks):
        for block in range(num_blocks):
            if block not in self.owned:
                assert torch.isnan(self.bound.ssm_state[block].float()).all(), f"ssm state of block {block} was written"
                assert torch.isnan(self.bound.conv_state[block].float()).all(), f"conv state of block {block} was written"


MODES = ["gdn", "kda"]


@pytest.mark.parametrize("mode", MODES)
def test_prefill_decode_and_graph_padding(mode, tmp_path, generator):
    """No speculation, no prefix caching: prefills (a 1-token first chunk among them), a batch of
    decodes in front of prefills (one continuing a chunked prefill), then a decode-only batch with
    two CUDA-graph padding rows staged in the builder's persistent buffers."""
    case = LayerCase(mode, tmp_path, generator, full_cuda_graph=True, num_blocks=14)
    r = [Request([b]) for b in (7, 3, 12, 5, 9)]

    rows = [(r[0], case.tokens(70), True), (r[1], case.tokens(5), True), (r[2], case.tokens(1), True),
            (r[3], case.tokens(33), True)]
    md, out = case.run(rows)
    assert (md.num_prefills, md.num_decodes) == (4, 0)
    case.check_outputs(out, rows)
    for request, new, _ in rows:
        request.committed += new

    rows = [(r[0], case.tokens(1), False), (r[1], case.tokens(1), False), (r[2], case.tokens(20), True),
            (r[4], case.tokens(9), True)]
    md, out = case.run(rows)
    assert (md.num_decodes, md.num_prefills) == (2, 2)
    assert md.cula_plan.decode is not None and md.cula_plan.prefill is not None
    case.check_outputs(out, rows)
    for request, new, _ in rows:
        request.committed += new

    rows = [(request, case.tokens(1), False) for request in r] + [None, None]
    md, out = case.run(rows, num_tokens=7)
    plan = md.cula_plan
    # vLLM counts the padding rows as decodes of the null block; they become cula-serve padding,
    # in the builder's buffer that a FULL graph replay reads.
    assert md.num_decodes == 7 and plan.decode.slots[5:].tolist() == [-1, -1]
    assert plan.decode.slots.untyped_storage().data_ptr() == case.builder.cula_decode_slots.untyped_storage().data_ptr()
    case.check_outputs(out, rows)
    for request, new, _ in rows[:5]:
        request.committed += new
    for request in r:
        case.check_state(request.blocks[0], request.committed, f"state of block {request.blocks[0]}")
    case.check_untouched(14)


@pytest.mark.parametrize("mode", MODES)
def test_speculative_verify(mode, tmp_path, generator):
    """num_spec = 2 (three state blocks per request): prefills, a uniform verify batch with
    CUDA-graph padding rows, a ragged verify batch mixed with a prefill, and a ragged verify-only
    batch, each reading the state column that the previous step's accepted count names."""
    case = LayerCase(mode, tmp_path, generator, num_spec=2, full_cuda_graph=True, num_blocks=16)
    r = [Request(blocks) for blocks in ([4, 11, 2], [9, 1, 14], [6, 13, 3], [10, 5, 8])]

    def advance(rows, accepted):
        """The previous verify's accepted prefix becomes committed; this batch's tokens pend."""
        for (request, new, _), a in zip(rows, accepted):
            request.committed += request.pending[:a]
            request.pending = new

    def settle_prefills(rows):
        for request, new, _ in rows:
            request.committed += new
            request.pending = []

    rows = [(r[0], case.tokens(40), True), (r[1], case.tokens(7), True), (r[2], case.tokens(1), True)]
    md, out = case.run(rows, draft_tokens=[-1, -1, -1], accepted=[1, 1, 1])
    assert md.num_spec_decodes == 0 and md.num_prefills == 3
    case.check_outputs(out, rows)
    settle_prefills(rows)

    # Uniform verify, 3 tokens per row, two padding rows (FULL graph staging).
    rows = [(request, case.tokens(3), False) for request in r[:3]]
    accepted = [1, 1, 1]
    advance(rows, accepted)
    md, out = case.run(rows + [None, None], draft_tokens=[2, 2, 2, -1, -1], accepted=accepted + [1, 1],
                       num_tokens=15)
    plan = md.cula_plan
    (step,) = plan.verify
    assert md.num_spec_decodes == 3 and step.num_tokens == 3 and step.token_index is None
    assert step.slots.untyped_storage().data_ptr() == case.builder.cula_verify_slots.untyped_storage().data_ptr()
    assert (case.builder.cula_verify_slots[3:5] == -1).all()
    case.check_outputs(out, rows)

    # Ragged verify (3, 1 and 2 tokens) mixed with a new prefill.
    accepted = [3, 1, 2]
    rows = [(r[0], case.tokens(3), False), (r[1], case.tokens(1), False), (r[2], case.tokens(2), False)]
    advance(rows, accepted)
    prefill = (r[3], case.tokens(12), True)
    md, out = case.run(rows + [prefill], draft_tokens=[2, 0, 1, -1], accepted=accepted + [1])
    plan = md.cula_plan
    assert md.num_spec_decodes == 3 and md.num_prefills == 1 and plan.spec_token_index is not None
    assert [step.num_tokens for step in plan.verify] == [1, 2, 3]
    case.check_outputs(out, rows + [prefill])
    settle_prefills([prefill])

    # Ragged verify only; r3's first verify after its prefill.
    accepted = [2, 1, 2, 1]
    rows = [(r[0], case.tokens(3), False), (r[1], case.tokens(3), False), (r[2], case.tokens(1), False),
            (r[3], case.tokens(2), False)]
    advance(rows, accepted)
    md, out = case.run(rows, draft_tokens=[2, 2, 0, 1], accepted=accepted)
    assert md.num_spec_decodes == 4 and [step.num_tokens for step in md.cula_plan.verify] == [1, 2, 3]
    case.check_outputs(out, rows)

    # Column t of each request holds the state after its committed tokens and t + 1 new ones.
    for request in r:
        for t, block in enumerate(request.blocks[: len(request.pending)]):
            case.check_state(block, request.committed + request.pending[: t + 1], f"state column {t}")
    case.check_untouched(16)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_caching_checkpoints(mode, tmp_path, generator):
    """'align' mode: a 150-token prefill is checkpointed at 128 tokens (recurrent state and
    convolution state into the block vLLM's planner names) and ends in the block of its last
    token; a 37-token prefill in the same batch has no checkpoint."""
    case = LayerCase(mode, tmp_path, generator, prefix_caching=True, num_blocks=16)
    spec = case.layer.get_kv_cache_spec(case.config)
    assert spec.prefill_checkpoint_alignment == 64 and spec.num_prefill_checkpoint_blocks == 1
    long, short = Request([1, 2, 3, 4, 5, 6, 7, 8, 11, 12]), Request([13, 14, 15])
    rows = [(long, case.tokens(150), True), (short, case.tokens(37), True)]
    md, out = case.run(rows)
    plan = md.cula_plan
    assert md.checkpoint is not None and plan.prefill.checkpoint_slots is not None
    assert plan.prefill.conv_checkpoints == ((128, 11),)
    case.check_outputs(out, rows)
    tokens = rows[0][1]
    case.check_state(12, tokens, "final state (block of token 150)")
    case.check_state(11, tokens[:128], "checkpoint state after 128 tokens")
    conv = case.layer.kv_cache[0][11].double()
    conv = conv if conv.shape[0] == case.dim else conv.transpose(0, 1)
    raw = torch.stack([t[0] for t in tokens[125:128]]).to(case.dtype).double()
    assert torch.equal(conv[:, : WIDTH - 1], raw.T), "checkpoint convolution state"
    case.check_state(15, rows[1][1], "final state of the short prefill (block of token 37)")
    # Blocks of earlier positions were not written by this step.
    for block in (1, 2, 3, 4, 5, 6, 7, 8, 13, 14):
        assert torch.isnan(case.bound.ssm_state[block].float()).all(), f"block {block} was written"
    case.owned -= {1, 2, 3, 4, 5, 6, 7, 8, 13, 14}
    case.check_untouched(16)


@pytest.mark.parametrize("mode, options", [
    ("kda", dict(lower_bound=-5.0)),          # Kimi-Linear's safe gate
    ("gdn", dict(ssm_dtype="bfloat16")),      # a bfloat16 recurrent state (vLLM's KDA layer keeps fp32)
], ids=["kda-safe-gate", "gdn-bf16-state"])
def test_gate_and_state_variants(mode, options, tmp_path, generator):
    """Prefill then decode with the safe gate, and with a bfloat16 state."""
    case = LayerCase(mode, tmp_path, generator, num_blocks=6, **options)
    if "ssm_dtype" in options:
        assert case.bound.ssm_state.dtype == torch.bfloat16
    r = [Request([2]), Request([4])]
    rows = [(r[0], case.tokens(21), True), (r[1], case.tokens(3), True)]
    md, out = case.run(rows)
    case.check_outputs(out, rows)
    for request, new, _ in rows:
        request.committed += new
    rows = [(request, case.tokens(1), False) for request in r]
    md, out = case.run(rows)
    case.check_outputs(out, rows)
    for request, new, _ in rows:
        request.committed += new
        case.check_state(request.blocks[0], request.committed, f"{case.bound.ssm_state.dtype} state")
    case.check_untouched(6)
