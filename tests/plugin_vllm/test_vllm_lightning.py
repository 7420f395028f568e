"""vLLM's Lightning layers (Bailing 2.5, MiniMax) with the cula plugin, on the CPU against the real
vLLM package.

Each test builds a tiny Bailing 2.5 config with ``--attention-backend cula``, constructs vLLM's
layer (the plugin swaps in its class) with random weights loaded through vLLM's weight loaders,
binds NaN-filled, page-strided state pages, and runs batches through vLLM's custom op
``vllm::linear_attention`` with metadata from the layer backend's builder given vLLM's
``CommonAttentionMetadata`` (tests/plugin_vllm/vllm_lightning.py).

- Against vLLM's own Lightning layer (its Triton kernels in Triton's interpreter): the same
  weights and batches (prefill, uniform and ragged speculative verify) give the same layer
  outputs, and the cula-written states are vLLM's states transposed (K-last vs K-first).
- Against the float64 oracle on the q, k, v vLLM's forward computed: prefills, decodes in front
  of prefills with a one-token first chunk among them, a decode-only batch with CUDA-graph padding
  rows; speculative verify (uniform with padding rows, ragged mixed with a prefill, ragged) after
  prompts shorter than 1 + num_spec; prefix-caching checkpoints; a bfloat16 state. Blocks no
  request owns (the null block 0 among them) must stay NaN.
- Tensor parallelism: two processes in one gloo group, each building the layer with tensor
  parallel size 2 (vLLM's real distributed init), serve their own two heads: their attention
  outputs and states are the full layer's heads, and the layer output after vLLM's all-reduce is
  the full layer's.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("vllm.version", reason="needs the vllm package (.ci/vllm.sh installs it)")

import vllm_harness as harness  # noqa: E402
import vllm_lightning  # noqa: E402
from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import BailingMoELinearAttention  # noqa: E402
from vllm.model_executor.layers.mamba.linear.minimax_linear_attn import MiniMaxText01LinearAttention  # noqa: E402
from vllm.v1.attention.backends.linear_attn import BailingLinearAttentionMetadata  # noqa: E402
from vllm_lightning import SHAPE, LightningCase, run_script  # noqa: E402

from conftest import assert_close  # noqa: E402
from cula_serve.integrations.vllm.layers import CulaBailingMoELinearAttention  # noqa: E402
from cula_serve.integrations.vllm.metadata import CulaLightningAttentionMetadata  # noqa: E402
from cula_serve.integrations.vllm.plugin import register  # noqa: E402

register()

Request = harness.Request


@pytest.fixture
def model(tmp_path):
    return harness.save_bailing_linear(tmp_path / "model", **SHAPE)


def settle(rows):
    """The batch's new tokens are now committed (prefill and decode rows)."""
    for row in rows:
        if row is not None:
            row[0].committed += row[1]


def advance(rows, accepted):
    """The previous verify's accepted prefix becomes committed; this batch's tokens pend."""
    for (request, new, _), a in zip(rows, accepted):
        request.committed += request.pending[:a]
        request.pending = new


def test_same_as_vllms_own_lightning_layer(model, generator):
    """The cula layer and vLLM's own (no flag; its Triton kernels interpreted) on the same weights
    and batches: prefills, then a uniform and a ragged verify (num_spec = 2)."""
    cula = LightningCase(BailingMoELinearAttention, model, generator, num_spec=2, num_blocks=8)
    own = LightningCase(BailingMoELinearAttention, model, generator, backend=None, weights=cula.weights,
                        num_spec=2, num_blocks=8)
    assert own.layer.cula is None and cula.layer.cula is not None
    r = [Request([2, 5, 7]), Request([6, 1, 3])]

    def run_both(rows, **kwargs):
        md_own, out_own = own.run(rows, **kwargs)
        md, out = cula.run(rows, **kwargs)
        assert isinstance(md_own, BailingLinearAttentionMetadata) and isinstance(md, CulaLightningAttentionMetadata)
        assert_close(out, out_own, 1e-5, "layer output against vLLM's own layer")
        cula.check_outputs(rows)
        for request, new, prefilling in rows:
            for block in request.blocks[: 1 if prefilling else len(new)]:
                # vLLM's kernels index a state K-first, cula-serve K-last: the same matrix.
                assert_close(cula.state[block].double(), own.state[block].double().transpose(-1, -2), 1e-5,
                             f"state of block {block} against vLLM's")

    rows = [(r[0], cula.tokens(9), True), (r[1], cula.tokens(6), True)]
    run_both(rows, draft_tokens=[-1, -1], accepted=[1, 1])
    settle(rows)
    rows = [(r[0], cula.tokens(3), False), (r[1], cula.tokens(3), False)]
    advance(rows, [1, 1])
    run_both(rows, draft_tokens=[2, 2], accepted=[1, 1])
    rows = [(r[0], cula.tokens(3), False), (r[1], cula.tokens(2), False)]
    advance(rows, [2, 3])
    run_both(rows, draft_tokens=[2, 1], accepted=[2, 3])


@pytest.mark.parametrize("layer_cls", [BailingMoELinearAttention, MiniMaxText01LinearAttention],
                         ids=["bailing", "minimax"])
def test_prefill_decode_and_graph_padding(layer_cls, model, generator):
    """Prefills (a one-token prompt among them); decodes in front of a one-token first chunk of a
    new request and a continuing prefill; a decode-only batch with two CUDA-graph padding rows
    staged in the builder's persistent buffers."""
    case = LightningCase(layer_cls, model, generator, full_cuda_graph=True, num_blocks=14)
    assert type(case.layer).__name__ == "Cula" + layer_cls.__name__
    r = [Request([b]) for b in (7, 3, 12, 5, 9)]

    rows = [(r[0], case.tokens(70), True), (r[1], case.tokens(5), True), (r[2], case.tokens(1), True),
            (r[3], case.tokens(33), True)]
    md, _ = case.run(rows)
    plan = md.cula_plan
    assert plan.decode is None and plan.prefill.slots.tolist() == [7, 3, 12, 5]
    assert not plan.prefill.has_initial_state.any()
    case.check_outputs(rows)
    settle(rows)

    # vLLM orders one-token rows first; r4's is the first chunk of a new request (its block holds
    # a recycled state, NaN here), so it and the rows after it run as prefills.
    rows = [(r[0], case.tokens(1), False), (r[1], case.tokens(1), False), (r[4], case.tokens(1), True),
            (r[2], case.tokens(20), True)]
    md, _ = case.run(rows)
    plan = md.cula_plan
    assert plan.decode.slots.tolist() == [7, 3]
    assert plan.prefill.slots.tolist() == [9, 12] and plan.prefill.has_initial_state.tolist() == [False, True]
    case.check_outputs(rows)
    settle(rows)

    rows = [(request, case.tokens(1), False) for request in r] + [None, None]
    md, _ = case.run(rows, num_tokens=7)
    plan = md.cula_plan
    assert plan.decode.slots.tolist() == [7, 3, 12, 5, 9, -1, -1]
    assert plan.decode.slots.untyped_storage().data_ptr() == case.builder.cula_decode_slots.untyped_storage().data_ptr()
    case.check_outputs(rows)
    settle(rows)
    for request in r:
        case.check_state(request.blocks[0], request.committed, f"state of block {request.blocks[0]}")
    case.check_untouched(14)


def test_speculative_verify(model, generator):
    """num_spec = 2: prompts of 40, 2 and 1 tokens (vLLM's own Lightning builder would verify the
    2-token one and leave its state in the wrong column), a uniform verify batch with CUDA-graph
    padding rows, a ragged verify batch mixed with a prefill, and a ragged verify-only batch."""
    case = LightningCase(BailingMoELinearAttention, model, generator, num_spec=2, full_cuda_graph=True,
                         num_blocks=16)
    r = [Request(blocks) for blocks in ([4, 11, 2], [9, 1, 14], [6, 13, 3], [10, 5, 8])]

    rows = [(r[0], case.tokens(40), True), (r[1], case.tokens(2), True), (r[2], case.tokens(1), True)]
    md, _ = case.run(rows, draft_tokens=[-1, -1, -1], accepted=[1, 1, 1])
    assert not md.cula_plan.verify and md.cula_plan.prefill.slots.tolist() == [4, 9, 6]
    case.check_outputs(rows)
    settle(rows)
    for request in r[:3]:
        case.check_state(request.blocks[0], request.committed, "prompt state in column 0")

    rows = [(request, case.tokens(3), False) for request in r[:3]]
    accepted = [1, 1, 1]
    advance(rows, accepted)
    md, _ = case.run(rows + [None, None], draft_tokens=[2, 2, 2, -1, -1], accepted=accepted + [1, 1], num_tokens=15)
    (step,) = md.cula_plan.verify
    assert step.num_tokens == 3 and step.token_index is None
    assert step.slots.untyped_storage().data_ptr() == case.builder.cula_verify_slots.untyped_storage().data_ptr()
    assert (case.builder.cula_verify_slots[3:5] == -1).all()
    case.check_outputs(rows + [None, None])

    accepted = [3, 1, 2]
    rows = [(r[0], case.tokens(3), False), (r[1], case.tokens(1), False), (r[2], case.tokens(2), False)]
    advance(rows, accepted)
    prefill = (r[3], case.tokens(12), True)
    md, _ = case.run(rows + [prefill], draft_tokens=[2, 0, 1, -1], accepted=accepted + [1])
    plan = md.cula_plan
    assert plan.spec_token_index is not None and [s.num_tokens for s in plan.verify] == [1, 2, 3]
    case.check_outputs(rows + [prefill])
    settle([prefill])

    accepted = [2, 1, 2, 1]
    rows = [(r[0], case.tokens(3), False), (r[1], case.tokens(3), False), (r[2], case.tokens(1), False),
            (r[3], case.tokens(2), False)]
    advance(rows, accepted)
    md, _ = case.run(rows, draft_tokens=[2, 2, 0, 1], accepted=accepted)
    assert [s.num_tokens for s in md.cula_plan.verify] == [1, 2, 3]
    case.check_outputs(rows)
    # Column t of each request holds the state after its committed tokens and t + 1 new ones.
    for request in r:
        for t, block in enumerate(request.blocks[: len(request.pending)]):
            case.check_state(block, request.committed + request.pending[: t + 1], f"state column {t}")
    case.check_untouched(16)


def test_prefix_caching_checkpoints(model, generator):
    """'align' mode: a 150-token prefill is checkpointed at 128 tokens into the block vLLM's planner
    names and ends in the block of its last token; a 37-token prefill has no checkpoint."""
    case = LightningCase(BailingMoELinearAttention, model, generator, prefix_caching=True, num_blocks=16)
    spec = case.layer.get_kv_cache_spec(case.config)
    assert spec.prefill_checkpoint_alignment == 64 and spec.num_prefill_checkpoint_blocks == 1
    long, short = Request([1, 2, 3, 4, 5, 6, 7, 8, 11, 12]), Request([13, 14, 15])
    rows = [(long, case.tokens(150), True), (short, case.tokens(37), True)]
    md, _ = case.run(rows)
    assert md.cula_plan.prefill.checkpoint_slots.tolist() == [[-1, 11], [-1, -1]]
    case.check_outputs(rows)
    tokens = rows[0][1]
    case.check_state(12, tokens, "final state (block of token 150)")
    case.check_state(11, tokens[:128], "checkpoint state after 128 tokens")
    case.check_state(15, rows[1][1], "final state of the short prefill (block of token 37)")
    case.owned -= {1, 2, 3, 4, 5, 6, 7, 8, 13, 14}  # blocks of earlier positions: not written
    case.check_untouched(16)


def test_bfloat16_state(model, generator):
    """``--mamba-cache-dtype bfloat16`` (what a bfloat16 model's Lightning states get by default):
    prefill, then decode."""
    case = LightningCase(BailingMoELinearAttention, model, generator, mamba_dtype="bfloat16", num_blocks=6)
    assert case.state.dtype == torch.bfloat16
    r = [Request([2]), Request([4])]
    for rows in ([(r[0], case.tokens(21), True), (r[1], case.tokens(3), True)],
                 [(request, case.tokens(1), False) for request in r]):
        case.run(rows)
        case.check_outputs(rows)
        settle(rows)
    for request in r:
        case.check_state(request.blocks[0], request.committed, "bfloat16 state")
    case.check_untouched(6)


def test_tensor_parallel_ranks_serve_their_heads(model, generator, tmp_path):
    """Two gloo ranks (separate processes, vLLM's distributed init, tensor parallel size 2) run
    prefills, decodes and a mixed batch; each serves its two of the four heads."""
    full = LightningCase(BailingMoELinearAttention, model, generator, num_blocks=8)
    hidden = full.hidden_size
    blocks = [[3], [6], [1]]
    script = [[(0, torch.randn(37, hidden, generator=generator), True),
               (1, torch.randn(5, hidden, generator=generator), True)],
              [(0, torch.randn(1, hidden, generator=generator), False),
               (1, torch.randn(1, hidden, generator=generator), False),
               (2, torch.randn(9, hidden, generator=generator), True)]]
    inputs = tmp_path / "inputs.pt"
    torch.save(dict(weights=full.weights, blocks=blocks, script=script, num_blocks=8), inputs)
    port = harness.free_port()
    env = dict(os.environ, TRITON_INTERPRET="1")
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    ranks = []
    try:
        for rank in (0, 1):
            with open(logs[rank], "w") as log:
                ranks.append(subprocess.Popen(
                    [sys.executable, vllm_lightning.__file__, "tp-rank", str(rank), "2", str(port), model, str(inputs),
                     str(tmp_path / f"rank{rank}.pt")], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        results, states = run_script(full, blocks, script)
        # A rank that fails leaves the other waiting in a collective: stop at the first failure.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(r.poll() == 0 for r in ranks) \
                and not any(r.poll() for r in ranks):
            time.sleep(0.2)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    failed = [f"rank {i} exited with {rank.returncode}:\n{log.read_text()[-4000:]}"
              for i, (rank, log) in enumerate(zip(ranks, logs)) if rank.returncode != 0]
    assert not failed, "\n".join(failed)  # a rank killed (-9) was left waiting by the one that failed

    local = full.H // 2
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        heads = slice(rank * local, (rank + 1) * local)
        assert got["layer"] == CulaBailingMoELinearAttention.__name__ and got["heads"] == local
        assert torch.equal(got["decay"], full.decay[heads])
        for (out_rank, core_rank), (out, core) in zip(got["results"], results):
            assert_close(core_rank, core[:, heads], 1e-5, f"rank {rank}'s attention output")
            assert_close(out_rank, out, 1e-5, f"rank {rank}'s layer output after the all-reduce")
        assert_close(got["states"], states[:, heads], 1e-5, f"rank {rank}'s states")
