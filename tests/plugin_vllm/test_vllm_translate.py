"""The vLLM plugin's translation layer without vLLM: vLLM-shaped metadata (vllm_shaped.py) into
cula-serve calls on vLLM-laid-out state pages, against the float64 oracle. Runs in the main test
environment; tests/gpu/test_vllm_layer_gpu.py runs the same batches on a GPU."""
import pytest
import torch

from conftest import ORACLE, SMALL, assert_close, tolerance
from cula_serve.integrations.vllm.translate import (DeltaRuleInputs, null_block_to_padding, plan_linear_attention,
                                                    run_delta_rule, split_tokens)
from vllm_shaped import Row, batch_metadata, gate_parameters, oracle_row, random_row_inputs, state_pages

MODES = ["gdn", "kda"]
NUM_BLOCKS = 24


def shape_of(mode):
    return SMALL if mode == "gdn" else dict(H=4, HV=4, K=16, V=16)


def run_batch(mode, rows, *, num_spec=0, padded_tokens=0, state_dtype=torch.float32, dtype=torch.float32,
              generator, slot_buffers=None):
    """Build the metadata and plan of ``rows``, fill the blocks the batch reads with random states,
    run it, and check outputs, written states and untouched blocks against the oracle."""
    shape = shape_of(mode)
    H, HV, K, V = (shape[x] for x in ("H", "HV", "K", "V"))
    _, pool = state_pages(NUM_BLOCKS, HV, V, K, state_dtype)
    md = batch_metadata(rows, num_spec=num_spec, padded_tokens=padded_tokens)
    plan = plan_linear_attention(md, **(slot_buffers or {}))
    params = gate_parameters(mode, HV, K, generator)

    reads = {}
    for r in rows:
        if r.kind == "pad" or (r.kind == "prefill" and not r.has_initial_state):
            continue
        block = r.blocks[r.num_accepted - 1] if r.kind == "verify" else r.blocks[0]
        pool[block] = (0.5 * torch.randn(HV, V, K, generator=generator)).to(state_dtype)
        reads[id(r)] = pool[block].clone()
    owned = {b for r in rows if r.kind != "pad" for b in r.blocks} | {r.checkpoint[1] for r in rows if r.checkpoint}
    untouched = set(range(NUM_BLOCKS)) - owned

    T = md.num_actual_tokens
    inputs = [random_row_inputs(mode, 0 if r.kind == "pad" else r.num_tokens, **shape, dtype=dtype,
                                generator=generator) for r in rows]
    batch = [torch.cat([x[i] for x in inputs]) for i in range(5)]
    batch = [torch.cat([t, torch.zeros(T - t.shape[0], *t.shape[1:], dtype=t.dtype)]) for t in batch]
    spec, rest = zip(*(split_tokens(plan, t) for t in batch))
    spec = None if spec[0] is None else DeltaRuleInputs(*spec)
    rest = None if rest[0] is None else DeltaRuleInputs(*rest)
    out = torch.zeros(T, HV, V, dtype=dtype)
    run_delta_rule(plan, mode, spec, rest, pool, out, **params)

    tol = tolerance(dtype, state_dtype)
    position = 0
    for r, x in zip(rows, inputs):
        n = x[0].shape[0]
        if r.kind == "pad":
            continue
        o, states = oracle_row(mode, *x, reads.get(id(r)), params, ORACLE)
        assert_close(out[position: position + n], o, tol, f"{r.kind} row output")
        if r.kind == "verify":
            for t in range(n):
                assert_close(pool[r.blocks[t]], states[t], tol, f"verify state column {t}")
        else:
            assert_close(pool[r.blocks[0]], states[-1], tol, f"{r.kind} state")
        if r.checkpoint:
            offset, block = r.checkpoint
            assert_close(pool[block], states[offset - 1], tol, "checkpoint state")
        position += n
    assert torch.all(out[position:] == 0), "padding tokens get zero output"
    for block in sorted(untouched):
        assert torch.isnan(pool[block].float()).all(), f"block {block} was written"
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
