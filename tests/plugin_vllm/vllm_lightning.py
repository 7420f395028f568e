"""A vLLM Lightning layer under test on the CPU: built as a model builds it, driven through
vLLM's custom op ``vllm::linear_attention`` batch by batch, with a float64 oracle.

Import this only after ``pytest.importorskip("vllm.version")`` (it imports vllm_harness). Under
``--attention-backend cula`` the layer is the plugin's, and the test records what vLLM's forward
handed its core (``_decode_infer``): the q, k, v of every token of the batch (after vLLM's
projections, norms and rotary embedding, q scaled) and the attention output. The oracle replays
each request's recorded tokens from scratch with cula-serve's float64 recurrence under vLLM's
Lightning definition: the state decays by ``exp(-slope)`` per token, ``S = decay S + k v^T``,
``o = S^T q`` (no further scale).

Run as a script (``python vllm_lightning.py tp-rank RANK WORLD PORT MODEL INPUTS OUTPUT``) it is
one rank of the tensor-parallel test: it joins a gloo group of WORLD processes, builds the layer
with tensor parallel size WORLD, loads the full weights through vLLM's loaders, runs the batches
of ``INPUTS`` (``run_script``) and saves what it recorded to ``OUTPUT``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a tensor-parallel rank: the tests' helpers as pytest would find them
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, as tests/conftest.py does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from cula_serve import cula_lightning  # noqa: E402
from conftest import ORACLE, assert_close, tolerance  # noqa: E402

PREFIX = "model.layers.0.self_attn"
# D = 64: vLLM's own Lightning prefill kernel takes head dims that are multiples of 64.
SHAPE = dict(H=4, D=64)


class LightningCase:
    """A bound Lightning layer (``layer_cls``: vLLM's class, the plugin's under ``cula``), its
    metadata builder, and per batch (``run``) the layer output and, under ``cula``, the core's
    recorded q, k, v and attention output.

    weights: checkpoint-shaped weights to load (default: random, kept in ``self.weights``).
    config: keyword arguments of ``vllm_harness.make_vllm_config``.
    """

    def __init__(self, layer_cls, folder, generator, *, weights=None, num_blocks=16, **config):
        self.generator = generator
        self.config = harness.make_vllm_config(folder, **config)

        def init(layer, g):
            self.weights = weights if weights is not None else harness.random_weights(layer, g)
            harness.load_weights(layer, self.weights)

        self.bound = harness.build_layer(layer_cls, self.config, PREFIX, num_blocks, generator, init_weights=init)
        self.layer = self.bound.layer
        self.builder = harness.metadata_builder(self.bound, PREFIX)
        self.H, self.D, self.hidden_size = self.layer.tp_heads, self.layer.head_dim, self.layer.hidden_size
        # vLLM's definition (its decode kernels): the state decays by exp(-slope) per token.
        self.decay = -self.layer.tp_slope.double().flatten()
        self.owned = set()
        self.core = None
        if getattr(self.layer, "cula", None) is not None:
            core = self.layer._decode_infer

            def recorded(q, k, v, *args):
                hidden = core(q, k, v, *args)
                self.core = dict(q=q.double(), k=k.double(), v=v.double(),
                                 hidden=hidden.double().unflatten(1, (self.H, self.D)))
                return hidden

            self.layer._decode_infer = recorded

    @property
    def state(self) -> torch.Tensor:
        """The layer's state pages [num_blocks, H, D, D]."""
        return self.bound.ssm_state

    def tokens(self, n):
        """n new tokens: their hidden states (the layer's input), float32 [hidden_size] each."""
        return [dict(x=x) for x in torch.randn(n, self.hidden_size, generator=self.generator)]

    def run(self, rows, *, draft_tokens=None, accepted=None, num_tokens=None):
        """Run one batch through ``vllm::linear_attention``. rows: (request, new tokens,
        is_prefilling) in vLLM's batch order, CUDA-graph padding rows as None. Stores the core's
        q, k, v in each new token (under ``cula``). Returns (metadata, layer output [T,
        hidden_size] float64)."""
        common, md = harness.build_batch(self.builder, rows, draft_tokens=draft_tokens, accepted=accepted,
                                         num_tokens=num_tokens)
        T = common.num_actual_tokens
        x = torch.zeros(T, self.hidden_size)
        positions = torch.zeros(T, dtype=torch.int64)
        batch = []
        for row in rows:
            if row is None:
                continue
            request, new, _ = row
            self.owned.update(request.blocks)
            start = len(batch)
            batch += new
            x[start: len(batch)] = torch.stack([t["x"] for t in new])
            positions[start: len(batch)] = torch.arange(request.length, request.length + len(new))
        out = torch.zeros(T, self.hidden_size)
        self.core = None
        with torch.no_grad(), set_forward_context({PREFIX: md}, self.config):
            torch.ops.vllm.linear_attention(x, out, positions, PREFIX)
        if self.core is not None:
            for i, token in enumerate(batch):
                token.update({name: self.core[name][i] for name in ("q", "k", "v")})
        return md, out.double()

    # -- the oracle --------------------------------------------------------------------------

    def oracle(self, tokens):
        """Attention outputs [n, H, D] and final state ([H, D, D], cula-serve's K-last order) of
        a request's tokens from a zero state, in float64."""
        q, k, v = (torch.stack([t[name] for t in tokens])[None] for name in ("q", "k", "v"))
        o, final = cula_lightning(q, k, v, self.decay, scale=1.0, output_final_state=True, **ORACLE)
        return o[0], final[0]

    def tol(self):
        return tolerance(torch.float32, self.state.dtype)

    def check_outputs(self, rows):
        """The core's output of the batch's rows against the oracle (a row's tokens: the request's
        committed tokens plus the new ones); padding tokens zero."""
        harness.check_row_outputs(self.core["hidden"], rows, self.oracle, self.tol())

    def check_state(self, block, tokens, what):
        _, final = self.oracle(tokens)
        assert_close(self.state[block].double(), final, self.tol(), what)

    def check_untouched(self, num_blocks):
        for block in range(num_blocks):
            if block not in self.owned:
                assert torch.isnan(self.state[block].float()).all(), f"state of block {block} was written"


def run_script(case: LightningCase, blocks, script):
    """Run a scripted sequence of plain (non-speculative) batches on ``case``.

    blocks: per request its blocks; script: batches, each a list of (request index, hidden
    states [n, hidden_size], is_prefilling). Returns per batch (layer output, core output [T, H,
    D]), and the final states of every request's block [R, H, D, D] (all float64)."""
    requests = [harness.Request(list(b)) for b in blocks]
    results = []
    for batch in script:
        rows = [(requests[r], [dict(x=t) for t in x], prefilling) for r, x, prefilling in batch]
        _, out = case.run(rows)
        results.append((out, case.core["hidden"]))
        for request, new, _ in rows:
            request.committed += new
    return results, torch.stack([case.state[r.blocks[0]].double() for r in requests])


def _tp_rank(rank: int, world: int, port: int, folder: str, inputs: str, output: str) -> None:
    from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import BailingMoELinearAttention

    from cula_serve.integrations.vllm.plugin import register

    register()
    data = torch.load(inputs)
    config = harness.make_vllm_config(folder)
    harness.init_distributed(config, world_size=world, rank=rank, port=port)
    case = LightningCase(BailingMoELinearAttention, folder, torch.Generator().manual_seed(0), weights=data["weights"],
                         num_blocks=data["num_blocks"])
    results, states = run_script(case, data["blocks"], data["script"])
    torch.save(dict(heads=case.H, decay=case.decay, results=results, states=states,
                    layer=type(case.layer).__name__), output)


if __name__ == "__main__":
    if len(sys.argv) != 8 or sys.argv[1] != "tp-rank":
        raise SystemExit(f"usage: {sys.argv[0]} tp-rank RANK WORLD PORT MODEL INPUTS OUTPUT")
    _tp_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
