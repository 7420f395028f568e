"""The vLLM plugin's layer-level path on a GPU, without vLLM: vLLM-shaped batch metadata
(tests/plugin_vllm/vllm_shaped.py, the fields vLLM's GDN builder fills, which the plugin plans
GDN, KDA and Lightning layers from) translated by ``cula_serve.integrations.vllm.translate`` into
cula-serve calls on the GPU's kernels, over state pages laid out as vLLM lays them out
(page-strided [num_blocks, HV, V, K] views; for Lightning vLLM's [num_blocks, H, D, D] pages
holding K-last states), at the model shapes of DESIGN section 1 (Lightning: 64 heads x 128, with
the float32 q, k, v vLLM's Lightning layers hand over), against the float64 oracle; and the
decode-only and uniform-verify batches that vLLM replays as FULL CUDA graphs, captured once and
replayed with new slots, accepted counts and inputs written into the same buffers.

Run with ``pytest -m gpu tests/gpu/test_vllm_layer_gpu.py`` (vLLM need not be installed).
"""
import sys
import zlib
from pathlib import Path

import pytest
import torch

from conftest import skip_module_unless_gpu, tolerance

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

# The vLLM-shaped batches are shared with the CPU translation tests in tests/plugin_vllm.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin_vllm"))

from cula_serve.inputs import MODE_SHAPES  # noqa: E402
from cula_serve.integrations.vllm.translate import plan_linear_attention  # noqa: E402
from vllm_shaped import (Row, batch_inputs, batch_metadata, check_rows, fill_reads, gate_parameters,  # noqa: E402
                         run_rows, state_pages)

DEVICE = torch.device("cuda")
MODES = ["gdn", "kda", "lightning"]
# The q, k, v dtype each vLLM layer hands cula-serve: the model's (bf16) for GDN / KDA; vLLM's
# Lightning layers compute q, k, v in float32.
INPUT_DTYPE = {"gdn": torch.bfloat16, "kda": torch.bfloat16, "lightning": torch.float32}
NUM_BLOCKS = 40


def _batch_inputs(mode, rows, num_tokens, generator):
    return batch_inputs(mode, rows, num_tokens, MODE_SHAPES[mode], dtype=INPUT_DTYPE[mode], generator=generator,
                        device=DEVICE)


def _out(mode, num_tokens):
    shape = MODE_SHAPES[mode]
    return torch.zeros(num_tokens, shape["HV"], shape["V"], dtype=INPUT_DTYPE[mode], device=DEVICE)


def _check(mode, rows, per_row, reads, out, pool, params, state_dtype):
    check_rows(mode, rows, per_row, reads, out, pool, params, tolerance(INPUT_DTYPE[mode], state_dtype))


BATCHES = {
    "decodes+padding": (0, 2, [Row("decode", (b,)) for b in (5, 17, 2, 33, 8)] + [Row("pad")] * 2),
    "decodes+prefills+checkpoint": (0, 0, [
        Row("decode", (3,)), Row("decode", (8,)), Row("prefill", (12,), 300, has_initial_state=True),
        Row("prefill", (20,), 200, has_initial_state=False, checkpoint=(192, 6)),
        Row("prefill", (1,), 1, has_initial_state=False)]),
    "uniform-verify+padding": (2, 6, [
        Row("verify", (4, 11, 2), 3, num_accepted=2), Row("verify", (9, 1, 14), 3, num_accepted=3),
        Row("verify", (6, 13, 3), 3, num_accepted=1), Row("pad"), Row("pad")]),
    "ragged-verify+prefill": (2, 0, [
        Row("verify", (4, 11, 2), 3, num_accepted=3), Row("verify", (9, 1, 14), 1, num_accepted=2),
        Row("verify", (6, 13, 3), 2, num_accepted=2), Row("prefill", (10,), 77, has_initial_state=True)]),
}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("mode", MODES)
def test_vllm_shaped_batch(mode, batch, state_dtype):
    generator = torch.Generator().manual_seed(zlib.crc32(f"{mode} {batch} {state_dtype}".encode()))
    num_spec, padded, rows = BATCHES[batch]
    shape = MODE_SHAPES[mode]
    _, pool = state_pages(NUM_BLOCKS, shape["HV"], shape["V"], shape["K"], state_dtype, device=DEVICE)
    md = batch_metadata(rows, num_spec=num_spec, device=DEVICE, padded_tokens=padded)
    plan = plan_linear_attention(md)
    params = gate_parameters(mode, shape["HV"], shape["K"], generator, device=DEVICE,
                             lower_bound=-5.0 if mode == "kda" else None)
    reads = fill_reads(rows, pool, generator)
    per_row, inputs = _batch_inputs(mode, rows, md.num_actual_tokens, generator)
    out = _out(mode, md.num_actual_tokens)
    run_rows(plan, mode, inputs, pool, out, params)
    torch.cuda.synchronize()
    _check(mode, rows, per_row, reads, out, pool, params, state_dtype)


def _graph_batches(kind):
    """Two batches of one CUDA-graph bucket (same row count and tokens per row): the one
    captured and the one replayed, with different blocks, accepted counts and padding."""
    if kind == "decode":
        return 0, 2, ([Row("decode", (b,)) for b in (5, 17, 2, 33)] + [Row("pad")] * 2,
                      [Row("decode", (b,)) for b in (9, 3, 21)] + [Row("pad")] * 3)
    first = [Row("verify", blocks, 3, num_accepted=a) for blocks, a in
             (((4, 11, 2), 1), ((9, 1, 14), 2), ((6, 13, 3), 3), ((20, 22, 24), 1))]
    second = [Row("verify", blocks, 3, num_accepted=a) for blocks, a in
              (((30, 31, 32), 3), ((15, 16, 18), 1))] + [Row("pad")] * 2
    return 2, 0, (first, second)


@pytest.mark.parametrize("kind", ["decode", "verify"])
@pytest.mark.parametrize("mode", MODES)
def test_full_cuda_graph_replay(mode, kind):
    """Capture a decode-only / uniform verify batch as vLLM's FULL graphs do (metadata in
    persistent buffers, slots translated into the builder's buffer), replay it with another
    batch written into the same buffers, and compare with the oracle."""
    generator = torch.Generator().manual_seed(7 + MODES.index(mode))
    num_spec, padded, (captured, replayed) = _graph_batches(kind)
    shape = MODE_SHAPES[mode]
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    num_tokens = sum(0 if r.kind == "pad" else r.num_tokens for r in captured) + padded
    params = gate_parameters(mode, HV, K, generator, device=DEVICE, lower_bound=-5.0 if mode == "kda" else None)
    _, pool = state_pages(NUM_BLOCKS, HV, V, K, torch.float32, device=DEVICE)

    # vLLM's persistent metadata buffers and the plugin builder's translated-slot buffer.
    index_field = "non_spec_state_indices_tensor" if kind == "decode" else "spec_state_indices_tensor"
    slots_out = torch.full((8,) if kind == "decode" else (8, 1 + num_spec), -1, dtype=torch.int32, device=DEVICE)
    vllm_indices = torch.zeros_like(slots_out)
    vllm_accepted = torch.ones(8, dtype=torch.int32, device=DEVICE)
    out = _out(mode, num_tokens)

    def stage(rows):
        """vLLM's builder for a FULL-graph batch: copy into the persistent buffers, plan."""
        md = batch_metadata(rows, num_spec=num_spec, device=DEVICE,
                            padded_tokens=num_tokens - sum(0 if r.kind == "pad" else r.num_tokens for r in rows))
        indices = getattr(md, index_field)
        vllm_indices[: indices.shape[0]].copy_(indices)
        setattr(md, index_field, vllm_indices[: indices.shape[0]])
        if kind == "verify":
            vllm_accepted[: md.num_accepted_tokens.shape[0]].copy_(md.num_accepted_tokens)
            md.num_accepted_tokens = vllm_accepted[: md.num_accepted_tokens.shape[0]]
        out_buffer = dict(decode_slots_out=slots_out) if kind == "decode" else dict(verify_slots_out=slots_out)
        return md, plan_linear_attention(md, **out_buffer)

    md, plan = stage(captured)
    fill_reads(captured, pool, generator)
    _, static_inputs = _batch_inputs(mode, captured, num_tokens, generator)
    run_rows(plan, mode, static_inputs, pool, out, params)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_rows(plan, mode, static_inputs, pool, out, params)

    pool.fill_(float("nan"))
    stage(replayed)
    reads = fill_reads(replayed, pool, generator)
    per_row, inputs = _batch_inputs(mode, replayed, num_tokens, generator)
    for static, new in zip(static_inputs, inputs):
        static.copy_(new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(mode, replayed, per_row, reads, out, pool, params, torch.float32)
