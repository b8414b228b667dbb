"""Where a merge from a mergekit config at its own dtype (``dtype: bfloat16``) spends its time:
``python -m mergelab merge --config`` on mergekit-spelled configs (ties, dare_ties, dare_linear,
breadcrumbs; mergekit's defaults, so DARE rescales by the L1 norm) with the accelerator on and
off (``MERGELAB_ACCELERATOR``) and, with ``--mergekit``, ``mergekit-yaml`` on the same file,
interleaved, on a small synthetic Llama-shaped bf16 set (about 60M parameters per model).

    python benchmarks/mergekit_dtype_speed.py                      # defaults: 8 layers, 2 rounds
    python benchmarks/mergekit_dtype_speed.py --profile ties       # + a cProfile of one run

Each run records wall seconds and the CPU seconds (user + system) of the child process, since the
machine may be shared: CPU seconds say how much work a run did, wall how long it took. The full
comparison with mergekit at the README's size is ``benchmarks/merge_speed.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_speed import _commit, save_results, write_checkpoint_set  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)

# mergekit's own spelling and defaults, as in its examples (dtype: bfloat16 throughout).
CONFIGS = {
    "ties": ({"normalize": True}, {"weight": 1.0, "density": 0.2}),
    "dare_ties": ({}, {"weight": 1.0, "density": 0.2}),
    "dare_linear": ({}, {"weight": 1.0, "density": 0.2}),
    "breadcrumbs": ({}, {"weight": 1.0, "density": 0.9, "gamma": 0.01}),
}


def mergekit_config(method: str, folder: Path, dtype: str) -> dict:
    global_params, model_params = CONFIGS[method]
    return {
        "merge_method": method,
        "base_model": str(folder / "base"),
        "models": [
            {"model": str(folder / e), "parameters": dict(model_params)}
            for e in ("expert_0", "expert_1")
        ],
        "parameters": global_params,
        "dtype": dtype,
    }


def command(tool: str, config: Path, out: Path) -> list[str]:
    """mergelab (``python -m mergelab merge --config``) or mergekit (``mergekit-yaml``) on the
    same mergekit-spelled config."""
    if tool == "mergekit":
        cmd = ["mergekit-yaml", str(config), str(out), "--random-seed", "0", "--quiet"]
        return [*cmd, "--no-write-model-card", "--no-copy-tokenizer"]
    cmd = [sys.executable, "-m", "mergelab", "merge", "--config", str(config)]
    return [*cmd, "--out", str(out), "--force", "--no-progress", "--seed", "0"]


def run_once(tool: str, config: Path, out: Path) -> dict:
    """One run of ``tool`` ("on" / "off": mergelab with the accelerator on or off; "mergekit"):
    wall seconds and the child's CPU seconds."""
    env = {**os.environ, "MERGELAB_ACCELERATOR": "off" if tool == "off" else "on"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    if tool == "mergekit" and out.exists():
        shutil.rmtree(out)  # our own output folder from the previous round
    cmd = command(tool, config, out)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=config.parent)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}


def same_bits(a: Path, b: Path) -> dict:
    """How many tensors of two merged folders differ in any bit (the accelerator on and off)."""
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    if files != sorted(p.name for p in b.glob("*.safetensors")):
        return {"tensors": None, "differing": None, "note": "different shard files"}
    tensors = differing = 0
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        for key, t in x.items():
            tensors += 1
            if key not in y or t.dtype != y[key].dtype or t.shape != y[key].shape:
                differing += 1
            elif not bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
                y[key].contiguous().view(-1).view(torch.uint8).numpy()
            ):
                differing += 1
    return {"tensors": tensors, "differing": differing}


def profile_once(config: Path, out: Path, accelerator: bool, top: int = 25) -> list[str]:
    """The ``top`` functions by cumulative time of one merge run in this process."""
    from mergelab.cli import main
    from mergelab.merge import accelerator as switch

    switch.set_enabled(accelerator)

    profiler = cProfile.Profile()
    argv = ["merge", "--config", str(config), "--out", str(out), "--force", "--no-progress"]
    profiler.runcall(main, [*argv, "--seed", "0"])
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue().splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default="/tmp/mergelab_bf16_set")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile", nargs="*", default=[], choices=list(CONFIGS))
    parser.add_argument("--mergekit", action="store_true", help="also run mergekit-yaml")
    parser.add_argument("--label", default="", help="a name for this run in the results file")
    parser.add_argument("--results", default="benchmarks/results/mergekit_dtype_speed.json")
    args = parser.parse_args()

    shape = {**SHAPE, "num_hidden_layers": args.layers}
    folder = Path(args.cache_dir) / f"llama-{args.layers}L"
    if not (folder / "spec.json").is_file():
        write_checkpoint_set(folder, shape)
    work = Path(args.cache_dir) / "outputs"
    work.mkdir(parents=True, exist_ok=True)
    configs = {}
    for method in args.methods:
        configs[method] = work / f"{method}.yml"
        configs[method].write_text(yaml.safe_dump(mergekit_config(method, folder, args.dtype)))

    tools = ["on", "off", *(["mergekit"] if args.mergekit else [])]
    runs: dict[str, dict[str, list[dict]]] = {m: {t: [] for t in tools} for m in args.methods}
    for r in range(args.rounds):
        for method in args.methods:
            for tool in tools if r % 2 == 0 else tools[::-1]:
                measured = run_once(tool, configs[method], work / f"{method}-{tool}")
                runs[method][tool].append(measured)
                print(f"round {r} {method:12s} {tool:8s} {measured}", flush=True)
    equal = {m: same_bits(work / f"{m}-on", work / f"{m}-off") for m in args.methods}
    print(f"accelerator on vs off, tensors differing: {equal}", flush=True)
    profiles = {}
    for method in args.profile:
        for mode in ("on", "off"):
            profiles[f"{method} accelerator {mode}"] = profile_once(
                configs[method], work / f"{method}-profile", mode == "on"
            )
    index = json.loads((folder / "base" / "model.safetensors.index.json").read_text())
    parameters = index["metadata"]["total_size"] // 2  # bf16: two bytes each
    record = {
        "label": args.label,
        "commit": _commit(),
        "set": {"shape": shape, "parameters": parameters, "stored": "bfloat16"},
        "configs": {m: mergekit_config(m, Path("SET"), args.dtype) for m in args.methods},
        "tools": {
            "on": "mergelab, accelerator on",
            "off": "mergelab, MERGELAB_ACCELERATOR=off (the methods themselves)",
            "mergekit": "mergekit-yaml 0.1.5 on the same config",
        },
        "load_average_after": list(os.getloadavg()),
        "runs": runs,
        "best": {
            m: {
                mode: {k: min(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
                for mode, rs in by_mode.items()
            }
            for m, by_mode in runs.items()
        },
        "on_vs_off_bits": equal,
        "profiles": profiles,
    }
    path = Path(args.results)
    existing = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    existing["runs"].append(record)
    save_results(path, existing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
