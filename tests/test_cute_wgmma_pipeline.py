"""The CuTe DSL GDN and KDA prefills keep their wgmma pipelined: compiled for SM90 on the CPU (where
nvidia-cutlass-dsl and triton's cuobjdump are installed), the SASS must not wait on every wgmma.
KDA's triangular solve (``solve_cute``) must run its products on the tensor cores, three tf32 mma
per product, without local memory; KDA's intra-chunk kernel (``intra_cute``) its blocks on mma.sync,
in loops short enough for the instruction cache.

ptxas serialises every wgmma of a kernel (a ``WARPGROUP.DEPBAR`` after each ``HGMMA``) when one
warpgroup's registers cannot hold its wgmma pipeline ("C7512 ... serialized due to insufficient
register resources"); GDN's state warpgroups at 184 registers did, with no change in results
(BENCHMARKS, 2026-11-26: what unserialising them took). Only a compile shows it, as it shows
GDN's spills (local memory loads), which its aux warpgroup's 104 registers are close to."""
import glob
import os
import re
import subprocess
import sys

import pytest

from cute_sm90 import GDN_PREFILL, KDA_INTRA, KDA_PREFILL

_SEGMENTED = "import sys\nSEGMENTED = sys.argv[1] == '1'\n"
_COMPILE = _SEGMENTED + GDN_PREFILL + "print('ok')\n"
_COMPILE_KDA = _SEGMENTED + KDA_PREFILL + "print('ok')\n"


def _cuobjdump():
    triton = pytest.importorskip("triton")
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        pytest.skip("no cuobjdump beside triton")
    return path


def _sass(tmp_path, source, *argv) -> str:
    """The SASS of the kernel ``source`` compiles for SM90 (run with ``argv``)."""
    pytest.importorskip("cutlass")
    cuobjdump = _cuobjdump()
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", source, *argv], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    (cubin,) = glob.glob(str(tmp_path / "*.cubin"))
    return subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def _wgmma_events(sass: str) -> str:
    """"G" for each HGMMA and "W" for each wait on the wgmma pipeline, in SASS order."""
    return "".join("G" if "HGMMA" in line else "W"
                   for line in sass.splitlines() if re.search(r"HGMMA|WARPGROUP\.DEPBAR", line))


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segmented"])
def test_gdn_prefill_wgmma_is_not_serialised(tmp_path, segmented):
    """Also few spills: reloads in the aux's solve cost it 10-25% (BENCHMARKS, 2026-11-28 14:10:
    13 -> 5 spill loads with P's product alone, 0.450 -> 0.412 ns per token-head; 49 with the
    exponents read early beside both products, 0.572)."""
    sass = _sass(tmp_path, _COMPILE, "1" if segmented else "0")
    events = _wgmma_events(sass)
    issues, waits = events.count("G"), events.count("W")
    # 44 wgmma a chunk (the aux's 16, the state's 28), waited on once per product group
    assert issues >= 44 and waits <= issues // 4, f"wgmma serialised: {events}"
    spill_loads = len(re.findall(r"\bLDL\b", sass))
    assert spill_loads <= 8, f"{spill_loads} spill loads (7 plain, 6 segmented since the state computes the norms)"


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segmented"])
def test_kda_prefill_wgmma_is_not_serialised(tmp_path, segmented):
    """KDA's state pass (``chunk_cute._kda_kernel``): the state warpgroups' 32 wgmma a chunk."""
    events = _wgmma_events(_sass(tmp_path, _COMPILE_KDA, "1" if segmented else "0"))
    issues, waits = events.count("G"), events.count("W")
    assert issues >= 32 and waits <= issues // 4, f"wgmma serialised: {events}"


def test_kda_solve_runs_on_the_tensor_cores(tmp_path):
    """``solve_cute``'s two doublings: 20 products of 16 x 8 x 8 tiles a warp, each three tf32 mma
    (hi hi, hi lo, lo hi), and nothing spilled."""
    source = "from cula_serve.kernels.delta_rule import solve_cute\nsolve_cute._compiled(32, True)\nprint('ok')\n"
    sass = _sass(tmp_path, source)
    assert len(re.findall(r"HMMA\.1688\.F32\.TF32", sass)) == 60
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory in the solve"


def test_kda_intra_chunk_kernel_is_small_and_on_the_tensor_cores(tmp_path):
    """``intra_cute``'s blocks of P and A: one loop body of two products of 16 x 16 x 128 (16 fp16
    mma each), nothing spilled, and the kernel's code a few thousand instructions: fully unrolled it
    was about 10,000 and its warps missed the instruction cache 41% of the time (ncu, H200)."""
    sass = _sass(tmp_path, KDA_INTRA + "print('ok')\n")
    assert len(re.findall(r"HMMA\.16816\.F32\b", sass)) == 32
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory in the intra-chunk kernel"
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE))
    assert instructions < 4000, f"{instructions} instructions"
