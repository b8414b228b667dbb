"""Wall time and peak memory of mergelab's streamed merge against mergekit's, on one checkpoint set.

    python benchmarks/merge_speed.py                 # ~0.5B-parameter Llama, bf16, base + 2 experts
    python benchmarks/merge_speed.py --threads 2 --methods ties linear
    python benchmarks/merge_speed.py --mergekit-config my/ties.yml   # any mergekit-spelled config

``--mergekit-config`` runs one config written in mergekit's spelling (``merge_method``) with both
``mergekit-yaml`` and ``mergelab merge --config`` (which reads it with mergekit's semantics), from
the config's folder (mergekit resolves relative model paths against the working folder), and
compares every tensor of the two outputs (largest absolute difference, and how many differ).

The checkpoints are synthetic (random tensors with Llama's tensor names and shapes, a real
``config.json``), written once into ``--cache-dir`` and reused. Each merge runs in its own
subprocess (``mergelab merge`` and ``mergekit-yaml``), both limited to ``--threads`` torch
threads, both computing in float32 and storing bf16. Peak RSS is the subprocess's maximum
resident set size as GNU ``/usr/bin/time`` reports it. Results go to ``--results`` as JSON (with the config that produced them) and are
printed as a table. Other processes on the machine add noise to wall times; RSS is not affected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

# ~0.5B parameters: 28 layers, hidden 1024, MLP 4096, 16 heads with 8 KV heads, vocab 32000.
LLAMA_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
)

# method -> (mergelab params, mergekit global parameters, mergekit per-model parameters).
# Both sides do the same maths: TIES trims per tensor (mergekit's only option), density 0.2,
# disjoint mean by count (= mergekit normalize with unit weights); task arithmetic unnormalised.
METHODS = {
    "linear": ({}, {"normalize": True}, {"weight": 1.0}),
    "task_arithmetic": ({"lambda": 1.0}, {"normalize": False, "lambda": 1.0}, {"weight": 1.0}),
    "ties": (
        {
            "density": 0.2,
            "lambda": 1.0,
            "trim_scope": "tensor",
            "weighted_sign": True,
            "divide_by": "weight_sum",
        },
        {"normalize": True, "lambda": 1.0},
        {"weight": 1.0, "density": 0.2},
    ),
    "dare_ties": (
        {"density": 0.2, "lambda": 1.0},
        {"normalize": True, "lambda": 1.0},
        {"weight": 1.0, "density": 0.2},
    ),
}


def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, m, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    names = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (m, h)),
            (f"{p}.mlp.up_proj.weight", (m, h)),
            (f"{p}.mlp.down_proj.weight", (h, m)),
        ]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return names


def write_checkpoint_set(folder: Path, shape: dict, shard_bytes: int = 2 * 10**8) -> None:
    """base, expert_0, expert_1: base ~ N(0, 0.02²); expert = base + N(0, 0.002²); bf16."""
    from transformers import LlamaConfig

    tensors = llama_tensors(shape)
    generator = torch.Generator().manual_seed(0)
    tmp = folder.with_name(folder.name + ".incomplete")
    shutil.rmtree(tmp, ignore_errors=True)
    names = ["base", "expert_0", "expert_1"]
    for n in names:
        (tmp / n).mkdir(parents=True)
        config = LlamaConfig(**shape, tie_word_embeddings=False, dtype="bfloat16")
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(tmp / n)
    # Shard by shard, so only one shard of each model is ever in memory.
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, s in tensors:
        size = 2 * torch.Size(s).numel()
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, s))
        used += size
    weight_maps: dict[str, dict[str, str]] = {n: {} for n in names}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        base = {}
        for name, s in shard:
            if name.endswith("norm.weight"):
                base[name] = (1 + 0.02 * torch.randn(s, generator=generator)).bfloat16()
            else:
                base[name] = (0.02 * torch.randn(s, generator=generator)).bfloat16()
        save_file(base, tmp / "base" / file, metadata={"format": "pt"})
        for e in names[1:]:
            expert = {
                name: (t.float() + 0.002 * torch.randn(t.shape, generator=generator)).bfloat16()
                for name, t in base.items()
            }
            save_file(expert, tmp / e / file, metadata={"format": "pt"})
        for n in names:
            weight_maps[n].update({name: file for name, _ in shard})
        print(f"  wrote shard {k + 1}/{len(shards)}", flush=True)
    total = 2 * sum(torch.Size(s).numel() for _, s in tensors)
    for n in names:
        index = {"metadata": {"total_size": total}, "weight_map": weight_maps[n]}
        (tmp / n / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "spec.json").write_text(json.dumps(shape))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


GNU_TIME = "/usr/bin/time"
RSS_TAG = "mergelab-bench-maxrss-kb="


def run_measured(
    cmd: list[str], env: dict[str, str], cwd: str | None = None
) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MiB, exit code) of one subprocess.

    Peak RSS comes from GNU time when present: Linux carries a process's ``ru_maxrss`` across
    fork + exec, so a child forked straight from this (torch-importing) script would report at
    least this script's own RSS. ``wait4`` is the fallback, with that floor.
    """
    use_time = os.path.exists(GNU_TIME)
    full = [GNU_TIME, "-f", RSS_TAG + "%M", *cmd] if use_time else cmd
    start = time.perf_counter()
    proc = subprocess.Popen(
        full, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if returncode != 0:
        print(f"command failed ({returncode}): {' '.join(cmd)}\n{stderr[-3000:]}")
    rss_kib = usage.ru_maxrss  # KiB on Linux
    if use_time:
        tagged = [line for line in stderr.splitlines() if line.startswith(RSS_TAG)]
        if tagged:
            rss_kib = int(tagged[-1].removeprefix(RSS_TAG))
    return wall, rss_kib / 1024, returncode


def run_repeated(
    cmd: list[str], env: dict[str, str], repeats: int, cwd: str | None = None
) -> tuple[float, float, int]:
    """Best wall time and highest peak RSS over ``repeats`` runs (the best time is the least
    disturbed by other processes; RSS does not depend on them)."""
    runs = [run_measured(cmd, env, cwd) for _ in range(repeats)]
    failed = [rc for _, _, rc in runs if rc != 0]
    return min(w for w, _, _ in runs), max(r for _, r, _ in runs), failed[0] if failed else 0


def compare_outputs(a: Path, b: Path, names: list[str]) -> float:
    """Max |a − b| over a few tensors of the two merged checkpoints (same maths → bf16 round-off)."""
    from mergelab.merge.checkpoint import CheckpointFolder

    with CheckpointFolder(a) as fa, CheckpointFolder(b) as fb:
        return max(float((fa.read(n).float() - fb.read(n).float()).abs().max()) for n in names)


def compare_all(a: Path, b: Path) -> dict:
    """Every tensor of two merged checkpoints: names, dtypes, largest |a − b|, entries differing."""
    from mergelab.merge.checkpoint import CheckpointFolder

    with CheckpointFolder(a) as fa, CheckpointFolder(b) as fb:
        names = sorted(fa.tensors)
        same_names = names == sorted(fb.tensors)
        max_diff, n_differ, n_total, dtypes_equal = 0.0, 0, 0, True
        for name in names if same_names else []:
            x, y = fa.read(name), fb.read(name)
            dtypes_equal &= x.dtype == y.dtype
            diff = (x.double() - y.double()).abs()
            max_diff = max(max_diff, float(diff.max()) if diff.numel() else 0.0)
            n_differ += int((diff > 0).sum())
            n_total += diff.numel()
    return {
        "same_tensor_names": same_names,
        "same_dtypes": bool(dtypes_equal),
        "max_abs_diff": max_diff,
        "entries_differing": n_differ,
        "entries": n_total,
    }


def run_mergekit_config(args: argparse.Namespace, env: dict[str, str]) -> int:
    """One mergekit-spelled config through both tools; times, peak RSS and a full comparison."""
    config = Path(args.mergekit_config).resolve()
    work = Path(args.cache_dir) / "outputs" / f"config-{config.stem}"
    work.mkdir(parents=True, exist_ok=True)
    ours, theirs = work / "mergelab", work / "mergekit"
    cmd = [sys.executable, "-m", "mergelab.cli", "merge", "--config", str(config)]
    cmd += ["--out", str(ours), "--force", "--no-progress", "--seed", "0"]
    row: dict = {"config": str(config)}
    row["mergelab_s"], row["mergelab_rss_mib"], rc = run_repeated(
        cmd, env, args.repeats, cwd=str(config.parent)
    )
    row["mergelab_ok"] = rc == 0
    shutil.rmtree(theirs, ignore_errors=True)
    cmd = ["mergekit-yaml", str(config), str(theirs), "-j", str(args.threads), "--quiet"]
    cmd += ["--random-seed", "0", "--no-write-model-card"]
    row["mergekit_s"], row["mergekit_rss_mib"], rc = run_repeated(
        cmd, env, args.repeats, cwd=str(config.parent)
    )
    row["mergekit_ok"] = rc == 0
    if row["mergelab_ok"] and row["mergekit_ok"]:
        row["speedup"] = row["mergekit_s"] / row["mergelab_s"]
        row.update(compare_all(ours, theirs))
    print(json.dumps(row, indent=2))
    record = {
        "config": {
            "mergekit_config": config.read_text(),
            "threads": args.threads,
            "repeats": args.repeats,
            "machine": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "rows": [row],
    }
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nresults: {results}")
    if not args.keep_outputs:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if row["mergelab_ok"] and row["mergekit_ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/mergelab/merge_speed"))
    parser.add_argument("--methods", nargs="+", default=["linear", "task_arithmetic", "ties"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LLAMA_SHAPE["num_hidden_layers"])
    parser.add_argument(
        "--results",
        help="JSON results file (default benchmarks/results/merge_speed.json, or "
        "merge_speed_config.json with --mergekit-config)",
    )
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tool; best time kept")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the merged checkpoints")
    parser.add_argument(
        "--mergekit-config",
        metavar="YAML",
        help="run this mergekit-spelled config with both tools instead (see the module docstring)",
    )
    args = parser.parse_args(argv)
    default_name = "merge_speed_config.json" if args.mergekit_config else "merge_speed.json"
    args.results = args.results or f"benchmarks/results/{default_name}"
    if args.mergekit_config:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "MKL_NUM_THREADS": str(args.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        return run_mergekit_config(args, env)

    shape = {**LLAMA_SHAPE, "num_hidden_layers": args.layers}
    folder = Path(args.cache_dir) / f"llama-{args.layers}L"
    if (
        not (folder / "spec.json").is_file()
        or json.loads((folder / "spec.json").read_text()) != shape
    ):
        print(f"writing synthetic checkpoints to {folder} (once)")
        write_checkpoint_set(folder, shape)
    n_params = sum(torch.Size(s).numel() for _, s in llama_tensors(shape))
    print(f"checkpoints: {folder} ({n_params / 1e9:.3f}B parameters each, bf16)")

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    work = Path(args.cache_dir) / "outputs"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    last = min(3, args.layers - 1)
    sample = ["model.layers.0.self_attn.q_proj.weight", f"model.layers.{last}.mlp.down_proj.weight"]
    for method in args.methods:
        ours, theirs_global, theirs_model = METHODS[method]
        base = None if method == "linear" else str(folder / "base")
        experts = [str(folder / "expert_0"), str(folder / "expert_1")]
        row = {"method": method}
        # mergelab
        cfg = {
            "method": method,
            "models": experts,
            "parameters": ours,
            "dtype": "float32",
            "seed": 0,
        }
        if base:
            cfg["base"] = base
        cfg_path = work / f"mergelab-{method}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        out_ours = work / f"mergelab-{method}"
        cmd = [sys.executable, "-m", "mergelab.cli", "merge", "--config", str(cfg_path)]
        cmd += ["--out", str(out_ours), "--force", "--no-progress"]
        row["mergelab_s"], row["mergelab_rss_mib"], rc = run_repeated(cmd, env, args.repeats)
        row["mergelab_ok"] = rc == 0
        # mergekit
        if not args.skip_mergekit:
            kcfg = {
                "merge_method": method,
                "models": [{"model": e, "parameters": dict(theirs_model)} for e in experts],
                "parameters": theirs_global,
                "dtype": "float32",
                "out_dtype": "bfloat16",
            }
            if base:
                kcfg["base_model"] = base
            kcfg_path = work / f"mergekit-{method}.yaml"
            kcfg_path.write_text(yaml.safe_dump(kcfg))
            out_theirs = work / f"mergekit-{method}"
            shutil.rmtree(out_theirs, ignore_errors=True)
            cmd = ["mergekit-yaml", str(kcfg_path), str(out_theirs), "-j", str(args.threads)]
            cmd += ["--quiet", "--random-seed", "0", "--no-write-model-card", "--no-copy-tokenizer"]
            row["mergekit_s"], row["mergekit_rss_mib"], rc = run_repeated(cmd, env, args.repeats)
            row["mergekit_ok"] = rc == 0
            if row["mergekit_ok"]:
                row["speedup"] = row["mergekit_s"] / row["mergelab_s"]
                row["rss_ratio"] = row["mergelab_rss_mib"] / row["mergekit_rss_mib"]
                if row["mergelab_ok"] and not method.startswith("dare"):
                    row["max_abs_diff_sample"] = compare_outputs(out_ours, out_theirs, sample)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not args.keep_outputs:  # 1 GB each; the inputs stay cached for the next run
            shutil.rmtree(out_ours, ignore_errors=True)
            shutil.rmtree(work / f"mergekit-{method}", ignore_errors=True)

    print()
    header = f"{'method':16s} {'mergelab s':>11s} {'mergekit s':>11s} {'speed-up':>9s} "
    header += f"{'mergelab RSS':>13s} {'mergekit RSS':>13s} {'RSS ratio':>10s}"
    print(header)
    for r in rows:
        print(
            f"{r['method']:16s} {r['mergelab_s']:11.1f} {r.get('mergekit_s', float('nan')):11.1f} "
            f"{r.get('speedup', float('nan')):8.2f}x {r['mergelab_rss_mib']:10.0f} MiB "
            f"{r.get('mergekit_rss_mib', float('nan')):9.0f} MiB {r.get('rss_ratio', float('nan')):10.2f}"
        )
    record = {
        "config": {
            "shape": shape,
            "n_params": n_params,
            "dtype": "bfloat16 stored, float32 compute",
            "threads": args.threads,
            "repeats": args.repeats,
            "methods": {m: METHODS[m] for m in args.methods},
            "machine": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nresults: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
