"""The vLLM plugin's translation layer without vLLM: vLLM-shaped metadata (vllm_shaped.py) into
cula-serve calls (GDN, KDA and Lightning) on vLLM-laid-out state pages, against the float64
oracle. Runs in the main test environment; tests/gpu/test_vllm_layer_gpu.py runs the same batches
on a GPU."""
import pytest
import torch

from conftest import SMALL, tolerance
from cula_serve.integrations.vllm.translate import null_block_to_padding, plan_linear_attention
from vllm_shaped import Row, batch_inputs, batch_metadata, check_rows, fill_reads, gate_parameters, run_rows, state_pages

MODES = ["gdn", "kda", "lightning"]
NUM_BLOCKS = 24


def shape_of(mode):
    return SMALL if mode == "gdn" else dict(H=4, HV=4, K=16, V=16)


def run_batch(mode, rows, *, num_spec=0, padded_tokens=0, state_dtype=torch.float32, dtype=torch.float32,
              generator, slot_buffers=None):
    """Build the metadata and plan of ``rows``, fill the blocks the batch reads with random states,
    run it, and check outputs, written states and untouched blocks against the oracle."""
    shape = shape_of(mode)
    HV, K, V = (shape[x] for x in ("HV", "K", "V"))
    _, pool = state_pages(NUM_BLOCKS, HV, V, K, state_dtype)
    md = batch_metadata(rows, num_spec=num_spec, padded_tokens=padded_tokens)
    plan = plan_linear_attention(md, **(slot_buffers or {}))
    params = gate_parameters(mode, HV, K, generator)

    reads = fill_reads(rows, pool, generator)
    per_row, batch = batch_inputs(mode, rows, md.num_actual_tokens, shape, dtype=dtype, generator=generator)
    out = torch.zeros(md.num_actual_tokens, HV, V, dtype=dtype)
    run_rows(plan, mode, batch, pool, out, params)
    check_rows(mode, rows, per_row, reads, out, pool, params, tolerance(dtype, state_dtype))
    return plan


def test_null_block_becomes_padding():
    indices = torch.tensor([[3, 0, 7], [0, 0, 0], [5, -1, 2]], dtype=torch.int32)
    assert null_block_to_padding(indices).tolist() == [[3, -1, 7], [-1, -1, -1], [5, -1, 2]]
    buffer = torch.full((5, 3), 99, dtype=torch.int32)
    result = null_block_to_padding(indices, out=buffer[:3])
    assert result.data_ptr() == buffer.data_ptr() and buffer[:3].tolist() == [[3, -1, 7], [-1, -1, -1], [5, -1, 2]]
    with pytest.raises(ValueError, match="out: expected int32"):
        null_block_to_padding(indices, out=torch.empty(3, 3, dtype=torch.int64))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decodes_with_graph_padding(mode, state_dtype, generator):
    rows = [Row("decode", (b,)) for b in (5, 17, 2)] + [Row("pad"), Row("pad")]
    buffers = dict(decode_slots_out=torch.full((8,), 7, dtype=torch.int32))
    plan = run_batch(mode, rows, padded_tokens=2, state_dtype=state_dtype, generator=generator,
                     slot_buffers=buffers)
    assert buffers["decode_slots_out"][:5].tolist() == [5, 17, 2, -1, -1]
    assert plan.decode.slots.data_ptr() == buffers["decode_slots_out"].data_ptr()


@pytest.mark.parametrize("mode", MODES)
def test_uniform_verify_with_graph_padding(mode, generator):
    rows = [Row("verify", (4, 11, 2), 3, num_accepted=2), Row("verify", (9, 1, 14), 3, num_accepted=3),
            Row("verify", (6, 13, 3), 3, num_accepted=1), Row("pad"), Row("pad")]
    buffers = dict(verify_slots_out=torch.full((8, 3), 7, dtype=torch.int32))
    plan = run_batch(mode, rows, num_spec=2, padded_tokens=6, generator=generator, slot_buffers=buffers)
    (step,) = plan.verify
    assert step.num_tokens == 3 and step.token_index is None
    assert buffers["verify_slots_out"][3:5].tolist() == [[-1, -1, -1]] * 2


@pytest.mark.parametrize("mode", MODES)
def test_decodes_before_prefills_with_a_checkpoint(mode, generator):
    rows = [Row("decode", (3,)), Row("decode", (8,)), Row("prefill", (12,), 70, has_initial_state=True),
            Row("prefill", (20,), 130, has_initial_state=False, checkpoint=(128, 6)),
            Row("prefill", (1,), 1, has_initial_state=False)]
    plan = run_batch(mode, rows, generator=generator)
    assert plan.prefill.checkpoint_slots.tolist() == [[-1, -1], [-1, 6], [-1, -1]]
    assert plan.prefill.conv_checkpoints == ((70 + 128, 6),)


@pytest.mark.parametrize("mode", MODES)
def test_ragged_verify_mixed_with_a_prefill(mode, generator):
    rows = [Row("verify", (4, 11, 2), 3, num_accepted=3), Row("verify", (9, 1, 14), 1, num_accepted=2),
            Row("verify", (6, 13, 3), 2, num_accepted=2), Row("prefill", (10,), 9, has_initial_state=True)]
    plan = run_batch(mode, rows, num_spec=2, generator=generator)
    assert [step.num_tokens for step in plan.verify] == [1, 2, 3]
    assert plan.spec_token_index is not None


def test_vllm_never_mixes_decodes_with_verify_rows():
    md = batch_metadata([Row("verify", (4, 11), 2), Row("prefill", (5,), 3)], num_spec=1)
    md.num_decodes = 1
    with pytest.raises(ValueError, match="never mixes plain decodes with verify rows"):
        plan_linear_attention(md)
