"""``python -m bench_serving kernels | decode-latency | offline``: see kernels.py, decode_latency.py, offline.py."""
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
    kernels.add_argument("--peers", nargs="*", default=None, help="only these peers (default: every installed one)")
    latency = sub.add_parser("decode-latency", help="decode and MTP verify + commit under CUDA-graph replay")
    latency.add_argument("--filter", default="", help="only models whose name contains this")
    latency.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    latency.add_argument("--verify-tokens", type=int, nargs="*", default=[2, 4, 8], help="none: decode only")
    latency.add_argument("--graph-layers", type=int, default=16,
                         help="also time decode and the dispatched verify + commit as one layer of a graph of this "
                              "many (batch sizes up to 64; 1: off)")
    latency.add_argument("--out-dir", default="bench_results")
    latency.add_argument("--seed", type=int, default=0)
    latency.add_argument("--peers", nargs="*", default=None, help="only these peers (default: every installed one)")
    from .offline import add_arguments as add_offline_arguments

    add_offline_arguments(sub.add_parser("offline", help="offline throughput of a model-shaped workload, cula vs FLA"))
    cp = sub.add_parser("dist", help="context-parallel prefill of one long sequence: 1 GPU against --nproc GPUs")
    cp.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each)")
    cp.add_argument("--models", nargs="+", default=["qwen3-next"], help="keys of cula_serve.inputs.MODEL_SHAPES")
    cp.add_argument("--tokens", type=int, nargs="+", default=[131072], help="sequence lengths")
    cp.add_argument("--weights", type=float, nargs="+", default=None, help="share of tokens per rank (default equal)")
    cp.add_argument("--reps", type=int, default=5)
    cp.add_argument("--out-dir", default="bench_results")
    args = parser.parse_args(argv)
    if args.command == "dist":
        from . import dist as dist_bench

        return dist_bench.main(args)
    if args.command == "offline":
        from . import offline

        return offline.main(args)
    if args.command == "decode-latency":
        from . import decode_latency

        return decode_latency.main(args)
    from . import kernels as kernels_bench

    return kernels_bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
