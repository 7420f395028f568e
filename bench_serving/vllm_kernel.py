"""vLLM's serving GDN decode kernel, run outside vLLM as a benchmark peer.

vLLM decodes Qwen3-Next's GDN layers with one Triton kernel,
``fused_sigmoid_gating_delta_rule_update`` (module
``vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py``): gating, delta rule and
in-place pool update fused, slots through ``ssm_state_indices``. vLLM itself cannot be installed
next to every torch (it pins one), but that module needs only torch and Triton: its one vLLM import,
``from vllm.triton_utils import tl, triton``, resolves to ``triton.language`` and ``triton`` on an
NVIDIA machine with Triton.

``load()`` finds the kernel in this order:
1. an installed vLLM (the real import);
2. a carrier wheel built by ``python -m bench_serving.vllm_kernel build DEST``: it downloads the
   vLLM wheel with pip, takes that one file unchanged (with vLLM's licence for the FLA-derived
   code) and packs it as ``bench_serving_vllm_kernel-<vllm version>-py3-none-any.whl``, small
   enough to carry to a machine without a package index. The file is executed unchanged; while it
   is imported, ``vllm.triton_utils`` is served by a stand-in holding the real ``triton`` and
   ``triton.language`` (removed again afterwards).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
KERNEL_IN_WHEEL = "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py"
LICENSE_IN_WHEEL = "vllm/third_party/flash_linear_attention/LICENSE"
REAL_MODULE = "vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating"
CARRIER = "bench_serving_vllm_kernel"  # import name and distribution name of the carrier wheel
FUNCTION = "fused_sigmoid_gating_delta_rule_update"


@contextlib.contextmanager
def _triton_utils_stand_in():
    """``vllm.triton_utils`` as it resolves on an NVIDIA machine with Triton, only while importing."""
    import triton
    import triton.language as tl

    name = "vllm.triton_utils"
    previous = sys.modules.get(name)
    stand_in = types.ModuleType(name)
    stand_in.triton, stand_in.tl = triton, tl
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous


def load_kernel_file(path: Path, module_name: str):
    """Import the kernel module at ``path`` (vLLM's file, unchanged) as ``module_name``, once:
    later calls return the same module, so Triton compiles its kernel once per process."""
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(loaded.__file__) == Path(path):
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    with _triton_utils_stand_in():
        spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def load():
    """(fused_sigmoid_gating_delta_rule_update, description). Raises ImportError saying why not."""
    try:
        module = importlib.import_module(REAL_MODULE)
        return getattr(module, FUNCTION), f"vllm {importlib.metadata.version('vllm')}"
    except ImportError:
        pass
    spec = importlib.util.find_spec(CARRIER)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"neither vllm nor the {CARRIER} carrier wheel is installed "
                          f"(python -m bench_serving.vllm_kernel build DEST makes it)")
    folder = Path(list(spec.submodule_search_locations)[0])
    source = json.loads((folder / "SOURCE.json").read_text())
    module = load_kernel_file(folder / "fused_sigmoid_gating.py", f"{CARRIER}.fused_sigmoid_gating")
    return getattr(module, FUNCTION), f"vllm {source['vllm_version']} kernel file (carrier wheel)"


def _record_line(name: str, data: bytes) -> list:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def carrier_wheel(kernel: bytes, license_text: bytes, vllm_version: str, dest: Path) -> Path:
    """Write the carrier wheel holding ``kernel`` (vLLM's file, unchanged) into ``dest``."""
    dist_info = f"{CARRIER}-{vllm_version}.dist-info"
    source = dict(vllm_version=vllm_version, path_in_vllm_wheel=KERNEL_IN_WHEEL,
                  sha256=hashlib.sha256(kernel).hexdigest())
    metadata = (f"Metadata-Version: 2.1\nName: {CARRIER}\nVersion: {vllm_version}\n"
                f"Summary: vLLM {vllm_version}'s {KERNEL_IN_WHEEL}, unchanged, for bench_serving\n"
                f"License: Apache-2.0 (vLLM), MIT (flash-linear-attention)\n").encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: bench_serving.vllm_kernel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {f"{CARRIER}/fused_sigmoid_gating.py": kernel,
             f"{CARRIER}/LICENSE": license_text,
             f"{CARRIER}/SOURCE.json": json.dumps(source, indent=1).encode(),
             f"{dist_info}/METADATA": metadata,
             f"{dist_info}/WHEEL": wheel}
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        writer.writerow(_record_line(name, data))
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{CARRIER}-{vllm_version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            # a fixed date: the same kernel file always gives the same wheel bytes (and sha256)
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return path


def build(dest: Path, vllm_version: str = VLLM_VERSION) -> Path:
    """Download the vLLM wheel (no dependencies) and write the carrier wheel into ``dest``."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_31_x86_64",
                        "--platform", "manylinux_2_35_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", tmp, f"vllm=={vllm_version}"], check=True)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one vllm wheel from pip download, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as zf:
            kernel, license_text = zf.read(KERNEL_IN_WHEEL), zf.read(LICENSE_IN_WHEEL)
    return carrier_wheel(kernel, license_text, vllm_version, dest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench_serving.vllm_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="download vLLM and write the carrier wheel into DEST")
    make.add_argument("dest", type=Path)
    make.add_argument("--vllm-version", default=VLLM_VERSION)
    sub.add_parser("check", help="say where the kernel would be loaded from")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.dest, args.vllm_version))
        return 0
    try:
        _, origin = load()
    except ImportError as err:
        print(f"vllm gdn decode kernel: not available ({err})")
        return 1
    print(f"vllm gdn decode kernel: {origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
