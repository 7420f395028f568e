"""``python -m bench_serving kernels | decode-latency``: see kernels.py and decode_latency.py."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench_serving", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    kernels = sub.add_parser("kernels", help="every operation, backend and installed peer at the model shapes")
    kernels.add_argument("--filter", default="", help="only cases whose name contains all these words")
    kernels.add_argument("--out-dir", default="bench_results", help="where kernels.json and kernels.png go")
    kernels.add_argument("--seed", type=int, default=0)
    latency = sub.add_parser("decode-latency", help="decode and MTP verify + commit under CUDA-graph replay")
    latency.add_argument("--filter", default="", help="only models whose name contains this")
    latency.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    latency.add_argument("--verify-tokens", type=int, nargs="+", default=[2, 4, 8])
    latency.add_argument("--out-dir", default="bench_results")
    latency.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "decode-latency":
        from . import decode_latency

        return decode_latency.main(args)
    from . import kernels as kernels_bench

    return kernels_bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
