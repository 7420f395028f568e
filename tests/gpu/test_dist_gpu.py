"""Context parallelism over NCCL on two GPUs (one process each) with the triton backend, against
the float64 oracle: the cases of tests/dist_cases.py at small shapes and at the model shapes
(DESIGN section 1). Run with ``pytest -m gpu tests/gpu/test_dist_gpu.py`` on a machine with two
or more GPUs; skipped with fewer."""
import pytest
import torch
import torch.multiprocessing as mp

from cula_serve.inputs import MODE_SHAPES

from conftest import skip_module_unless_gpu
import dist_cases

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

SMALL = dict(H=2, HV=4, K=16, V=16)  # the Triton kernels take head dims of 16 and up


@pytest.mark.parametrize("shapes", [SMALL, MODE_SHAPES], ids=["small", "model-shapes"])
def test_context_parallel_over_nccl_matches_the_oracle(shapes, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    mp.spawn(dist_cases.worker, args=(2, str(tmp_path / "init"), "cuda", shapes, "triton"), nprocs=2, join=True)
