"""Where a merge from a mergekit config at its own dtype (``dtype: bfloat16``) spends its time:
``python -m mergelab merge --config`` on mergekit-spelled configs (linear, ties, dare_ties,
dare_linear, breadcrumbs; mergekit's defaults, so DARE rescales by the L1 norm) with the
accelerator on and off (``MERGELAB_ACCELERATOR``), with ``--before DIR`` also the mergelab in
``DIR`` (an older commit's tree, its loops built: a before/after in one run) and, with
``--mergekit``, ``mergekit-yaml`` on the same file, interleaved (every tool once per method and
round, the order reversed every other round), on a small synthetic Llama-shaped bf16 set (about
60M parameters per model).

    python benchmarks/mergekit_dtype_speed.py                      # defaults: 8 layers, 2 rounds
    python benchmarks/mergekit_dtype_speed.py --mergekit --before /tmp/old-tree --no-off
    python benchmarks/mergekit_dtype_speed.py --profile ties       # + a cProfile of one run

Each run records wall seconds, the CPU seconds (user + system) and the peak RSS of the child
process (GNU time where present, ``merge_speed.run_measured``), since the machine may be shared:
CPU seconds say how much work a run did, wall how long it took. The summary (``ratios``) gives,
per method and tool, mergekit's time over the tool's (CPU and wall, best of the rounds), the
tool's time over its own linear merge of the same three checkpoints (``linear`` in the
methods: the config's models, each weight 1, mergekit's normalised average), and both peak RSS.
The full comparison with mergekit at the README's size is ``benchmarks/merge_speed.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_speed import (  # noqa: E402
    _commit,
    run_measured,
    save_results,
    write_checkpoint_set,
)

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
    "linear": ({"normalize": True}, {"weight": 1.0}),
    "ties": ({"normalize": True}, {"weight": 1.0, "density": 0.2}),
    "dare_ties": ({}, {"weight": 1.0, "density": 0.2}),
    "dare_linear": ({}, {"weight": 1.0, "density": 0.2}),
    "breadcrumbs": ({}, {"weight": 1.0, "density": 0.9, "gamma": 0.01}),
}


def mergekit_config(method: str, folder: Path, dtype: str) -> dict:
    """mergekit's spelling of ``method`` over the set in ``folder``; linear averages the same
    three checkpoints the others read (mergekit's linear takes no base model)."""
    global_params, model_params = CONFIGS[method]
    names = ["base", "expert_0", "expert_1"] if method == "linear" else ["expert_0", "expert_1"]
    config = {
        "merge_method": method,
        "models": [{"model": str(folder / e), "parameters": dict(model_params)} for e in names],
        "parameters": global_params,
        "dtype": dtype,
    }
    if method != "linear":
        config["base_model"] = str(folder / "base")
    return config


def command(tool: str, config: Path, out: Path) -> list[str]:
    """mergelab (``python -m mergelab merge --config``) or mergekit (``mergekit-yaml``) on the
    same mergekit-spelled config."""
    if tool == "mergekit":
        cmd = ["mergekit-yaml", str(config), str(out), "--random-seed", "0", "--quiet"]
        return [*cmd, "--no-write-model-card", "--no-copy-tokenizer"]
    cmd = [sys.executable, "-m", "mergelab", "merge", "--config", str(config)]
    return [*cmd, "--out", str(out), "--force", "--no-progress", "--seed", "0"]


def run_once(tool: str, config: Path, out: Path, before: str | None) -> dict:
    """One run of ``tool`` ("on" / "off": mergelab with the accelerator on or off; "before": the
    mergelab in ``before``, accelerator on; "mergekit"): wall and CPU seconds, peak RSS (MiB)."""
    env = {**os.environ, "MERGELAB_ACCELERATOR": "off" if tool == "off" else "on"}
    tree = before if tool == "before" else str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = tree
    if tool == "mergekit" and out.exists():
        shutil.rmtree(out)  # our own output folder from the previous round
    cmd = command(tool, config, out)
    done = run_measured(cmd, env, cwd=str(config.parent))
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode})")
    return {"wall_s": round(done.wall, 3), "cpu_s": round(done.cpu, 3), "rss_mib": done.rss_mib}


def ratios(best: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Per method and mergelab tool: mergekit's best time over the tool's (CPU and wall), the
    tool's best time over its own linear merge's, and the peak RSS of both tools."""
    found: dict[str, dict[str, dict]] = {}
    linear = best.get("linear", {})
    for method, by_tool in best.items():
        theirs = by_tool.get("mergekit")
        for tool, ours in by_tool.items():
            if tool == "mergekit":
                continue
            row: dict = {"rss_mib": round(ours["rss_mib"])}
            if theirs is not None:
                row["mergekit_over_this_cpu"] = round(theirs["cpu_s"] / ours["cpu_s"], 2)
                row["mergekit_over_this_wall"] = round(theirs["wall_s"] / ours["wall_s"], 2)
                row["mergekit_rss_mib"] = round(theirs["rss_mib"])
            if tool in linear:
                row["over_linear_cpu"] = round(ours["cpu_s"] / linear[tool]["cpu_s"], 2)
                row["over_linear_wall"] = round(ours["wall_s"] / linear[tool]["wall_s"], 2)
            found.setdefault(method, {})[tool] = row
    return found


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
    parser.add_argument("--before", help="also run the mergelab in this tree (loops built)")
    parser.add_argument("--before-commit", help="the commit --before's tree was exported from")
    parser.add_argument("--no-off", action="store_true", help="skip the accelerator-off runs")
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

    tools = ["on", *([] if args.no_off else ["off"]), *(["before"] if args.before else [])]
    tools += ["mergekit"] if args.mergekit else []
    runs: dict[str, dict[str, list[dict]]] = {m: {t: [] for t in tools} for m in args.methods}
    for r in range(args.rounds):
        for method in args.methods:
            for tool in tools if r % 2 == 0 else tools[::-1]:
                out = work / f"{method}-{tool}"
                measured = run_once(tool, configs[method], out, args.before)
                runs[method][tool].append(measured)
                print(f"round {r} {method:12s} {tool:8s} {measured}", flush=True)
    other = "off" if "off" in tools else "before" if "before" in tools else None
    equal = None
    if other is not None:
        equal = {m: same_bits(work / f"{m}-on", work / f"{m}-{other}") for m in args.methods}
    print(f"on vs {other}, tensors differing: {equal}", flush=True)
    profiles = {}
    for method in args.profile:
        for mode in ("on", "off"):
            profiles[f"{method} accelerator {mode}"] = profile_once(
                configs[method], work / f"{method}-profile", mode == "on"
            )
    best = {
        m: {
            tool: {k: min(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
            | {"rss_mib": max(r["rss_mib"] for r in rs)}
            for tool, rs in by_tool.items()
        }
        for m, by_tool in runs.items()
    }
    print(json.dumps(ratios(best), indent=1), flush=True)
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
            "before": f"mergelab from {args.before}, accelerator on",
            "mergekit": "mergekit-yaml 0.1.5 on the same config",
        },
        "before_commit": args.before_commit,
        "load_average_after": list(os.getloadavg()),
        "runs": runs,
        "best": best,
        "ratios": ratios(best),
        f"on_vs_{other}_bits": equal,
        "profiles": profiles,
    }
    path = Path(args.results)
    existing = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    existing["runs"].append(record)
    save_results(path, existing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
