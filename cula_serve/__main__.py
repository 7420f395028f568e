"""``python -m cula_serve info`` (what can run here and why) and ``python -m cula_serve demo``."""
from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__, dispatch


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def info() -> None:
    """Print the device, every backend's availability with the reason, the dispatch order, and the
    backend each model shape's decode and verify get at a few batch sizes."""
    device = _device()
    print(f"cula-serve {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        print(f"device: {device} {torch.cuda.get_device_name(device)} (sm_{major}{minor})")
    else:
        print("device: cpu (no CUDA device visible)")
    print("backends:")
    for name in dispatch.BACKENDS:
        module, reason = dispatch.backend_status(name, device)
        print(f"  {name:7s} {'available' if module else 'not available: ' + reason}")
    forced = dispatch.requested_backend(None)
    print(f"dispatch on {device}" + (f" (CULA_BACKEND={forced} forces it)" if forced else "") + ":")
    for op in dispatch.OPERATIONS:
        order = dispatch.preference(op, device)
        chosen = next((b for b in order if (module := dispatch.backend_status(b, device)[0]) is not None
                       and op in module.OPERATIONS), None)
        print(f"  {op:8s} {' > '.join(order):24s} -> {forced or chosen}")
    # a backend may pass calls of some sizes to the next one (``defers``): what the model shapes get
    from .inputs import MODEL_SHAPES
    print("per call, at the model shapes (B = 1 / 64 / 256 sequences):")
    for model, shape in MODEL_SHAPES.items():
        for op, T in (("decode", 1), ("verify", 4)):
            for state_dtype in (torch.float32, torch.bfloat16):
                picks = [dispatch.automatic_backend(op, device, dict(mode=shape["mode"], N=B, T=T, HV=shape["HV"],
                                                                     state_dtype=state_dtype))
                         for B in (1, 64, 256)]
                print(f"  {model:12s} {op:8s} {str(state_dtype)[6:]:8s} pool {' / '.join(picks)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cula_serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, backends and dispatch order")
    demo_parser = sub.add_parser("demo", help="prefill -> decode -> verify -> commit, checked against the oracle")
    demo_parser.add_argument("--mode", choices=("gdn", "kda", "lightning"), default=None,
                             help="one family (default: all three)")
    demo_parser.add_argument("--backend", choices=dispatch.BACKENDS, default=None)
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
        return 0
    from .demo import run_demo

    return run_demo(_device(), modes=[args.mode] if args.mode else ["gdn", "kda", "lightning"],
                    backend=args.backend)


if __name__ == "__main__":
    sys.exit(main())
