"""``python -m bench_serving offline --engine vllm|sglang``: the engine's own offline benchmark,
run twice in subprocesses (the engine's attention backends as it picks them, then
``--attention-backend cula``) on a random-token trace with the same lengths as ``offline``'s.

    vLLM:   python -m vllm.entrypoints.cli.main bench throughput --model M --dataset-name random
            --input-len I --output-len O --random-range-ratio R --num-prompts N --output-json F
    SGLang: python -m sglang.benchmark.offline_throughput (sglang.bench_offline_throughput before
            0.5.2x) --model-path M --dataset-name random --random-input-len I --random-output-len O
            --random-range-ratio R --num-prompts N --result-filename F

It runs only where the engine, a GPU, the model's weights (a local directory or the Hugging Face
cache: nothing is downloaded) and cula-serve's plugin for that engine are all present; otherwise
it says, in one line, which one is missing.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# the checkpoint of each model shape (DESIGN section 1) that the engines serve
CHECKPOINTS = {
    "qwen3-next": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "kimi-linear": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
    "minimax": "MiniMaxAI/MiniMax-Text-01",
}
PLUGIN_GROUPS = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}


def _model_available(model: str) -> bool:
    if Path(model, "config.json").is_file():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def _cula_plugin(engine: str):
    """The entry point through which cula-serve registers with ``engine``, or None."""
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUPS[engine]):
        if ep.value.split(":")[0].split(".")[0] == "cula_serve":
            return ep
    return None


def _sglang_module() -> str:
    for module in ("sglang.benchmark.offline_throughput", "sglang.bench_offline_throughput"):
        if importlib.util.find_spec(module) is not None:
            return module
    raise ImportError("no sglang offline throughput module (sglang.benchmark.offline_throughput)")


def unavailable_reason(engine: str, model: str) -> str | None:
    """Why the engine benchmark cannot run here, in one line; None when it can."""
    names = {"vllm": "vLLM", "sglang": "SGLang"}
    if importlib.util.find_spec(engine) is None:
        return f"{names[engine]} is not installed (pip install 'cula-serve[{engine}]')"
    if not torch.cuda.is_available():
        return f"{names[engine]}'s offline benchmark needs a GPU"
    if not _model_available(model):
        return (f"model {model} is not available locally (not a directory with config.json, not in the "
                f"Hugging Face cache); download it or pass a local path with --engine-model")
    if _cula_plugin(engine) is None:
        return (f"cula-serve's {names[engine]} plugin is not installed (no {PLUGIN_GROUPS[engine]} entry point "
                f"from cula_serve), so --attention-backend cula cannot be selected")
    return None


def command(engine: str, model: str, *, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
            seed: int, result_file: Path, cula: bool) -> list[str]:
    """The engine's offline benchmark command line."""
    if engine == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model", model,
               "--dataset-name", "random", "--input-len", str(input_len), "--output-len", str(output_len),
               "--random-range-ratio", str(range_ratio), "--num-prompts", str(num_prompts), "--seed", str(seed),
               "--output-json", str(result_file)]
    else:
        cmd = [sys.executable, "-m", _sglang_module(), "--model-path", model, "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--random-range-ratio", str(range_ratio), "--num-prompts", str(num_prompts), "--seed", str(seed),
               "--result-filename", str(result_file)]
    return cmd + (["--attention-backend", "cula"] if cula else [])


def _tokens_per_second(engine: str, result_file: Path) -> float:
    text = result_file.read_text()
    if engine == "vllm":
        return float(json.loads(text)["tokens_per_second"])
    # SGLang appends one JSON line per run
    return float(json.loads(text.strip().splitlines()[-1])["total_throughput"])


def run(engine: str, model_shape: str, args, out_dir: Path) -> dict:
    """Run the engine benchmark with and without cula-serve; returns a JSON-ready dict."""
    model = args.engine_model or CHECKPOINTS[model_shape]
    reason = unavailable_reason(engine, model)
    if reason:
        print(f"--engine {engine}: {reason}: no engine benchmark")
        return dict(engine=engine, model=model, skipped=reason)
    spread = args.spread if args.distribution == "uniform" else 0.0
    results = dict(engine=engine, model=model, runs=[])
    for cula in (False, True):
        result_file = out_dir / f"offline_{engine}_{'cula' if cula else 'default'}.json"
        result_file.unlink(missing_ok=True)
        cmd = command(engine, model, num_prompts=args.num_requests, input_len=args.input_len,
                      output_len=args.output_len, range_ratio=spread, seed=args.seed, result_file=result_file,
                      cula=cula)
        label = "--attention-backend cula" if cula else "default attention backends"
        print(f"{engine} {label}: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, env=dict(os.environ))
        run_result = dict(attention_backend="cula" if cula else "default", command=cmd, returncode=done.returncode)
        if done.returncode == 0 and result_file.is_file():
            run_result["tokens_per_second"] = _tokens_per_second(engine, result_file)
            print(f"{engine} {label}: {run_result['tokens_per_second']:.1f} tokens/s")
        else:
            print(f"{engine} {label}: failed with exit code {done.returncode}")
        results["runs"].append(run_result)
    default, cula = results["runs"]
    if "tokens_per_second" in default and "tokens_per_second" in cula:
        results["cula_vs_default"] = cula["tokens_per_second"] / default["tokens_per_second"]
        print(f"{engine}: cula-serve {results['cula_vs_default']:.2f}x the default backends' throughput")
    return results
