"""Wall time and peak memory of mergelab's streamed merges against mergekit's and against the
time it takes just to read the inputs and write one output.

Two tables. The first is what a mergekit user runs: mergekit-format configs (``merge_method``,
``dtype: bfloat16`` as in every mergekit example, mergekit's defaults otherwise: DARE rescales by
the L1 norm), each tool at its defaults on the same file with the same arguments
(``mergekit-yaml config.yml OUT`` and ``mergelab merge config.yml OUT``, plus ``--random-seed 0
--quiet`` for both and ``--no-write-model-card --no-copy-tokenizer`` for mergekit, as in the
second table): seconds, mergekit's over mergelab's (wall, and CPU), mergelab's over its own
linear merge of the same two experts (the table's ``linear`` row), and both peak RSS
(``mergekit_format_rows`` in the results). The second is the float32-compute table (``rows``):
the variants below, spelled in each tool's own dialect, both computing in float32 and storing
bf16.

    python benchmarks/merge_speed.py --repeats 2                 # defaults: each tool's own threads
    python benchmarks/merge_speed.py --repeats 2 --threads 1     # both pinned to one thread
    python benchmarks/merge_speed.py --variants ties dare_ties --layers 12   # a quick look
    python benchmarks/merge_speed.py --format-variants             # the float32 table only
    python benchmarks/merge_speed.py --mergekit-config my/ties.yml   # any mergekit-spelled config

The checkpoints are synthetic: a base and two experts with Llama's tensor names and shapes (59
layers, hidden 1024, MLP 4096: 0.95B parameters each, bf16), base ~ N(0, 0.02²), expert = base +
N(0, 0.002²) (dense task vectors), a real ``config.json``. They are written once into
``--cache-dir`` (git-ignored ``.cache/``) and reused. Each merge runs in its own subprocess
(``mergelab merge`` and ``mergekit-yaml``), interleaved (every variant of both tables with both
tools once per round, ``--repeats`` rounds, the tools' order alternating), best wall time kept. Without ``--threads`` each tool runs at its default thread count (what users
run); ``--threads N`` sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and mergekit's ``-j`` for both.

The floors are subprocesses (``benchmarks/io_floor.py``) that import torch (both tools do), read
every byte of the input shards of the variant's models and then write one output of the merged
size, flushed to disk (``fsync``, as mergelab's output is): the least a tool that reads its inputs
and writes its output that way can take. They keep Python's garbage collector out of torch's
import and end without the interpreter's teardown, as the ``mergelab`` command does. "direct"
maps the inputs and writes with ``O_DIRECT`` (as mergelab does); "buffered" uses ``read()`` and
``write()`` through the page cache (as a plain tool does). They run in every round too (``--only-floor`` measures just them,
into an existing results file).
Before the first round the inputs are read once (page cache) and an output-sized file is written
and deleted: on a VM the first writes into never-used memory cost several times more, whichever
tool comes first. From then on the inputs and every file either tool's process loads stay
mapped by the benchmark (:class:`Resident`: this VM pages out file pages nobody maps once they
look idle for a minute, a single read not counting as use, so during a long run of one tool the
inputs and the other tool's libraries left the page cache, and runs waited on the disk). Every
run starts after ``sync`` (nothing of the previous run is still being written back to disk) and
with its inputs read through once more (still in the page cache).
Each run also records how long the machine waited meanwhile, on I/O, for a CPU and for the
hypervisor (``runs_waits_s``, :func:`machine_waits`): where a run's wall time went that its CPU
time does not.

mergelab's compiled loops are a C extension built when the package is installed; the results
record which file a merge process loads (``compiled_loops``; ``None`` would mean the torch path
ran). mergelab's modules are byte-compiled first, as an installed package's are.

Peak RSS is the subprocess's maximum resident set size as GNU ``/usr/bin/time`` reports it. The
machine's load average before and after goes into the results (``--results``, JSON with the
config that produced them); other processes on the machine add noise to wall times, not to RSS.

``--mergekit-config`` runs one config written in mergekit's spelling (``merge_method``) with both
``mergekit-yaml`` and ``mergelab merge --config`` (which reads it with mergekit's semantics), from
the config's folder (mergekit resolves relative model paths against the working folder), and
compares every tensor of the two outputs (largest absolute difference, and how many differ).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from io_floor import io_floor, shard_files
from safetensors.torch import save_file

# ~0.95B parameters: 59 layers, hidden 1024, MLP 4096, 16 heads with 8 KV heads, vocab 32000.
LLAMA_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=59,
    num_attention_heads=16,
    num_key_value_heads=8,
)

# A set small enough for the tests of the benchmark scripts.
TINY_SHAPE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)

# variant -> (mergelab method, mergelab params, mergekit method or None, mergekit global
# parameters, mergekit per-model parameters). density 0.2 throughout (breadcrumbs: 0.9 with
# gamma 0.01, the method's usual setting).
# * ties: mergekit's semantics (per-tensor trim, sign election and division weighted), the same
#   maths in both tools; ties_count / ties_model / ties_model_count: the other sign rule and the
#   paper's whole-model trim, which mergekit does not offer.
# * dare_*: each tool's own default rescale (mergelab: the paper's 1/density; mergekit: the L1
#   norm), so the draws and the outputs differ; the work per entry is the same.
MERGEKIT_TIES = {"density": 0.2, "lambda": 1.0, "trim_scope": "tensor", "weighted_sign": True}
VARIANTS: dict[str, tuple[str, dict, str | None, dict, dict]] = {
    "linear": ("linear", {}, "linear", {"normalize": True}, {"weight": 1.0}),
    "task_arithmetic": (
        "task_arithmetic",
        {"lambda": 1.0},
        "task_arithmetic",
        {"normalize": False, "lambda": 1.0},
        {"weight": 1.0},
    ),
    "ties": (
        "ties",
        {**MERGEKIT_TIES, "divide_by": "weight_sum"},
        "ties",
        {"normalize": True, "lambda": 1.0},
        {"weight": 1.0, "density": 0.2},
    ),
    "ties_count": (
        "ties",
        {"density": 0.2, "trim_scope": "tensor", "majority_sign": "count"},
        None,
        {},
        {},
    ),
    "ties_model": ("ties", {"density": 0.2, "trim_scope": "model"}, None, {}, {}),
    "ties_model_count": (
        "ties",
        {"density": 0.2, "trim_scope": "model", "majority_sign": "count"},
        None,
        {},
        {},
    ),
    "dare_linear": (
        "dare_linear",
        {"density": 0.2, "lambda": 1.0},
        "dare_linear",
        {"lambda": 1.0},
        {"weight": 1.0, "density": 0.2},
    ),
    "dare_ties": (
        "dare_ties",
        {"density": 0.2, "lambda": 1.0},
        "dare_ties",
        {"normalize": True, "lambda": 1.0},
        {"weight": 1.0, "density": 0.2},
    ),
    "breadcrumbs": (
        "breadcrumbs",
        {"density": 0.9, "gamma": 0.01},
        "breadcrumbs",
        {"lambda": 1.0},
        {"weight": 1.0, "density": 0.9, "gamma": 0.01},
    ),
}
DEFAULT_VARIANTS = list(VARIANTS)

# The first table: mergekit-format configs as a mergekit user writes them (mergekit's defaults,
# ``dtype: bfloat16``): variant -> (merge_method, global parameters, per-model parameters).
MERGEKIT_FORMAT: dict[str, tuple[str, dict, dict]] = {
    "linear": ("linear", {}, {"weight": 1.0}),
    "ties": ("ties", {}, {"weight": 1.0, "density": 0.2}),
    "dare_ties": ("dare_ties", {}, {"weight": 1.0, "density": 0.2}),
    "dare_linear": ("dare_linear", {}, {"weight": 1.0, "density": 0.2}),
    "breadcrumbs": ("breadcrumbs", {}, {"weight": 1.0, "density": 0.9, "gamma": 0.01}),
}
# What both tools get after ``config.yml OUT`` in the first table (mergelab takes mergekit's
# flags); mergekit also gets what the float32 table gives it, ``--no-write-model-card
# --no-copy-tokenizer`` (mergelab refuses both: it always writes its model card and the base's
# tokenizer where there is one; the synthetic set has none)
MERGEKIT_FORMAT_FLAGS = ["--random-seed", "0", "--quiet"]
MERGEKIT_ONLY_FLAGS = ["--no-write-model-card", "--no-copy-tokenizer"]


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
RSS_TAG = "mergelab-bench="


class Measured(NamedTuple):
    wall: float  # seconds
    rss_mib: float  # peak
    cpu: float  # user + system seconds
    returncode: int
    waits: dict[str, float]  # machine_waits() during the run (seconds)


def machine_waits() -> dict[str, float]:
    """Seconds since boot the machine spent waiting, as the kernel counts them: ``io_full``
    (every runnable task stalled on I/O, /proc/pressure/io), ``cpu_some`` (some runnable task
    waited for a CPU, /proc/pressure/cpu) and ``steal`` (the hypervisor ran something else on
    this VM's CPUs, /proc/stat, all CPUs together). Keys whose file is missing are left out.
    Their growth during a run says where a run's wall time went that its CPU time does not."""
    waits: dict[str, float] = {}
    for key, path, line in (("io_full", "io", "full"), ("cpu_some", "cpu", "some")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for row in Path(f"/proc/pressure/{path}").read_text().splitlines():
                if row.startswith(line):
                    waits[key] = int(row.rsplit("total=", 1)[1]) / 1e6
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        waits["steal"] = int(fields[8]) / os.sysconf("SC_CLK_TCK")
    return waits


def run_measured(
    cmd: list[str], env: dict[str, str], cwd: str | None = None, warm: list[Path] = ()
) -> Measured:
    """Wall seconds, peak RSS in MiB, CPU seconds (user + system), exit code of one subprocess,
    and how long the machine waited on I/O, for a CPU or for the hypervisor meanwhile
    (:func:`machine_waits`).

    RSS and CPU time come from GNU time when present: Linux carries a process's ``ru_maxrss``
    across fork + exec, so a child forked straight from this (torch-importing) script would
    report at least this script's own RSS. ``wait4`` is the fallback, with that floor.
    """
    use_time = os.path.exists(GNU_TIME)
    full = [GNU_TIME, "-f", RSS_TAG + "%M %U %S", *cmd] if use_time else cmd
    # the previous run's output still being written back to disk would slow this one's writes
    # (mergekit does not flush its output): every run starts with nothing left to write, and
    # with its inputs in the page cache (a 3 GiB mergekit run can push some out)
    os.sync()
    read_through(warm)
    before = machine_waits()
    start = time.perf_counter()
    proc = subprocess.Popen(
        full, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    after = machine_waits()
    waits = {key: round(after[key] - before[key], 2) for key in after.keys() & before.keys()}
    if returncode != 0:
        print(f"command failed ({returncode}): {' '.join(cmd)}\n{stderr[-3000:]}")
    rss_kib, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime  # KiB on Linux
    tagged = [line for line in stderr.splitlines() if line.startswith(RSS_TAG)]
    if use_time and tagged:
        kib, user, system = tagged[-1].removeprefix(RSS_TAG).split()
        rss_kib, cpu = int(kib), float(user) + float(system)
    return Measured(wall, rss_kib / 1024, cpu, returncode, waits)


def run_repeated(
    cmd: list[str], env: dict[str, str], repeats: int, cwd: str | None = None
) -> tuple[float, float, int]:
    """Best wall time and highest peak RSS over ``repeats`` runs (the best time is the least
    disturbed by other processes; RSS does not depend on them)."""
    runs = [run_measured(cmd, env, cwd) for _ in range(repeats)]
    failed = [r.returncode for r in runs if r.returncode != 0]
    return min(r.wall for r in runs), max(r.rss_mib for r in runs), failed[0] if failed else 0


def _threads_flag(threads: int | None) -> list[str]:
    return [] if threads is None else ["-j", str(threads)]


def tool_env(threads: int | None) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
        if threads is not None:
            env[key] = str(threads)
    return env


# --- keeping the inputs and the tools in the page cache ----------------------------------------

# What a tool's process loads, printed by a probe that imports what the tool imports: every
# module's source and byte code and every file the process maps (shared libraries)
_FILES_PROBE = """
import importlib.util, json, os, sys
{imports}
files = set()
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if path:
        files.add(os.path.realpath(path))
        if path.endswith(".py"):
            files.add(os.path.realpath(importlib.util.cache_from_source(path)))
for line in open("/proc/self/maps"):
    parts = line.split(maxsplit=5)
    if len(parts) == 6 and parts[5].startswith("/"):
        files.add(os.path.realpath(parts[5].strip()))
print(json.dumps(sorted(f for f in files if os.path.isfile(f))))
"""
# mergelab's compiled loops, where this revision keeps them (merge_ab.py runs older ones too)
LOOPS_IMPORT = (
    "try:\n    from mergelab.merge.accelerator import kernels\n"
    "except ImportError:\n    from mergelab.merge import kernels\n"
)
TOOL_IMPORTS = {
    "mergelab": "import mergelab.cli, mergelab.merge.cli\n" + LOOPS_IMPORT + "kernels.loops()",
    "mergekit": "import mergekit.scripts.run_yaml",
}


def tool_files(env: dict[str, str], cwd: Path | None = None) -> list[Path]:
    """The files each tool's process loads (:data:`TOOL_IMPORTS`); a tool that is not
    installed adds none."""
    files: set[Path] = set()
    for tool, imports in TOOL_IMPORTS.items():
        done = subprocess.run(
            [sys.executable, "-c", _FILES_PROBE.replace("{imports}", imports)],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            files.update(Path(f) for f in json.loads(done.stdout))
        else:
            print(f"{tool}: not importable, its files are not held ({done.stderr.strip()[-200:]})")
    return sorted(files)


def proactive_reclaim() -> str | None:
    """What this machine's kernel pages out on its own (DAMON schemes that page out memory,
    /sys/kernel/mm/damon), or ``None``."""
    found = []
    for kdamond in sorted(Path("/sys/kernel/mm/damon/admin/kdamonds").glob("[0-9]*")):
        with contextlib.suppress(OSError):
            if (kdamond / "state").read_text().strip() != "on":
                continue
            for scheme in sorted(kdamond.glob("contexts/*/schemes/[0-9]*")):
                if (scheme / "action").read_text().strip() == "pageout":
                    age = scheme / "access_pattern/age/min"
                    aggr = scheme.parent.parent / "monitoring_attrs/intervals/aggr_us"
                    idle_s = int(age.read_text()) * int(aggr.read_text()) / 1e6
                    found.append(f"DAMON pages out memory idle for {idle_s:g} s")
    return "; ".join(found) or None


class Resident:
    """Holds files in the page cache: a read-only shared map of each, filled at once
    (``MAP_POPULATE``), for as long as this object (in practice: the benchmark's process) lives.

    Some VMs page out file pages that no process maps once they look idle for a while, even
    with most memory free (:func:`proactive_reclaim`; on this project's machine: pages its
    monitor saw used at most once per 5 s window for 60 s, up to 128 MiB a second; one read of
    a file does not count as use, ``benchmarks/page_cache_hold.py``). Over a benchmark that
    evicts the inputs while a long run of the other tool goes on (and during the next run,
    whose reads then wait on the disk), and the libraries of the tool that ran least recently.
    Mapped pages are left alone, so the benchmark maps the inputs and both tools' files for its
    whole length: every run finds them in memory, as on a machine that keeps its page cache,
    whichever tool ran before."""

    def __init__(self, paths: list[Path]) -> None:
        self.maps: list[mmap.mmap] = []
        self.bytes = 0
        for path in paths:
            with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self.maps.append(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))
                self.bytes += size

    def summary(self) -> dict:
        return {"files": len(self.maps), "mib": round(self.bytes / 2**20)}


# --- the read-and-write floor ------------------------------------------------------------------


def read_through(folders: list[Path]) -> None:
    """Read every shard of ``folders`` (into the page cache, where they mostly are already)."""
    buffer = bytearray(64 << 20)
    for shard in shard_files(folders):
        with open(shard, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def warm_up(folder: Path, out_bytes: int, work: Path) -> None:
    """Inputs into the page cache; an output-sized file written and deleted (see docstring)."""
    models = [folder / n for n in ("base", "expert_0", "expert_1")]
    io_floor(models, out_bytes, work / "warm-up", mode="buffered")


FLOORS = ("direct", "buffered")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def compile_sources() -> None:
    """Byte-compile mergelab's modules, as ``pip install`` does: with ``PYTHONDONTWRITEBYTECODE``
    set (as on the project's machines) an editable install would otherwise compile every
    changed module from source in every timed run."""
    import compileall

    import mergelab

    compileall.compile_dir(Path(mergelab.__file__).parent, quiet=1)


def compiled_loops(env: dict[str, str]) -> str | None:
    """The file of mergelab's compiled loops a merge process loads (``None``: they were not
    built, or are switched off, and the merges run the plain torch methods)."""
    code = LOOPS_IMPORT + "print(kernels.loops().__file__ if kernels.active() else '')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    found = done.stdout.strip() or None
    print(f"compiled loops: {found or 'none (the torch path runs)'}")
    return found


# --- the benchmark --------------------------------------------------------------------------


def mergelab_command(variant: str, folder: Path, work: Path) -> tuple[list[str], Path]:
    method, params, *_ = VARIANTS[variant]
    experts = [str(folder / "expert_0"), str(folder / "expert_1")]
    cfg = {"method": method, "models": experts, "parameters": params, "dtype": "float32"}
    cfg["seed"] = 0
    if method != "linear":
        cfg["base"] = str(folder / "base")
    path = work / f"mergelab-{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = work / f"mergelab-{variant}"
    cmd = [sys.executable, "-m", "mergelab.cli", "merge", "--config", str(path)]
    return [*cmd, "--out", str(out), "--force", "--no-progress"], out


def mergekit_command(
    variant: str, folder: Path, work: Path, threads: int | None
) -> tuple[list[str], Path] | None:
    _, _, method, global_params, model_params = VARIANTS[variant]
    if method is None:
        return None
    experts = [str(folder / "expert_0"), str(folder / "expert_1")]
    cfg = {
        "merge_method": method,
        "models": [{"model": e, "parameters": dict(model_params)} for e in experts],
        "parameters": global_params,
        "dtype": "float32",
        "out_dtype": "bfloat16",
    }
    if method != "linear":
        cfg["base_model"] = str(folder / "base")
    path = work / f"mergekit-{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = work / f"mergekit-{variant}"
    cmd = ["mergekit-yaml", str(path), str(out), *_threads_flag(threads), "--quiet"]
    return [*cmd, "--random-seed", "0", "--no-write-model-card", "--no-copy-tokenizer"], out


def mergekit_format_commands(
    variant: str, folder: Path, work: Path, threads: int | None
) -> dict[str, tuple[list[str], Path]]:
    """The first table's runs: one mergekit-format config (:data:`MERGEKIT_FORMAT`, ``dtype:
    bfloat16``) and, per tool, the command that merges it and its output folder."""
    method, global_params, model_params = MERGEKIT_FORMAT[variant]
    experts = [str(folder / "expert_0"), str(folder / "expert_1")]
    cfg: dict = {
        "merge_method": method,
        "models": [{"model": e, "parameters": dict(model_params)} for e in experts],
        "dtype": "bfloat16",
    }
    if global_params:
        cfg["parameters"] = dict(global_params)
    if method != "linear":
        cfg["base_model"] = str(folder / "base")
    path = work / f"format-{variant}.yml"
    path.write_text(yaml.safe_dump(cfg))
    tools = {
        "mergelab": [sys.executable, "-m", "mergelab.cli", "merge"],
        "mergekit": ["mergekit-yaml", *_threads_flag(threads)],
    }
    found = {}
    for tool, head in tools.items():
        out = work / f"format-{tool}-{variant}"
        extra = MERGEKIT_ONLY_FLAGS if tool == "mergekit" else []
        found[tool] = ([*head, str(path), str(out), *MERGEKIT_FORMAT_FLAGS, *extra], out)
    return found


def require_this_tree() -> None:
    """Stop unless the ``mergelab`` this process imported is this checkout's: an in-process
    benchmark times the code it imports, and a virtual environment with an editable install of
    another clone would otherwise supply that clone's code (and compiled loops) unnoticed."""
    import mergelab

    root = Path(__file__).resolve().parent.parent
    where = Path(mergelab.__file__).resolve().parent
    if not where.is_relative_to(root):
        raise SystemExit(
            f"mergelab is imported from {where}, not from this checkout ({root}): "
            f"run with PYTHONPATH={root}, or pip install -e . here"
        )


def _commit() -> str | None:
    """The checked-out commit, with "+changes" when mergelab's files differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    head = git("rev-parse", "HEAD").strip()
    if not head:
        return None
    return head + ("+changes" if git("status", "--porcelain", "--", "mergelab").strip() else "")


def add_set_arguments(parser: argparse.ArgumentParser, results: str) -> None:
    """The options of a benchmark that runs on a synthetic set this script made: where the
    sets live, which one (``--layers``), where its results go (default ``results``)."""
    parser.add_argument("--cache-dir", default=".cache/merge_speed")
    parser.add_argument("--results", default=results)
    parser.add_argument(
        "--layers",
        type=int,
        default=LLAMA_SHAPE["num_hidden_layers"],
        help="the synthetic set of this many layers (made by merge_speed.py --layers N)",
    )


def synthetic_set(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[Path, Path, list[Path]]:
    """The set ``add_set_arguments`` chose, made earlier by this script: its folder, the folder
    for outputs beside it (created), and its three models (base, expert_0, expert_1); a parser
    error if it was never made."""
    folder = Path(args.cache_dir).resolve() / f"llama-{args.layers}L"
    if not (folder / "spec.json").is_file():
        parser.error(
            f"no synthetic checkpoints in {folder}: run benchmarks/merge_speed.py"
            f" --layers {args.layers} once"
        )
    work = Path(args.cache_dir).resolve() / "outputs"
    work.mkdir(parents=True, exist_ok=True)
    return folder, work, [folder / n for n in ("base", "expert_0", "expert_1")]


def run_config(
    folder: Path, args: argparse.Namespace, held: Resident, load_before: list[float]
) -> dict:
    """The ``config`` record of a run of the scripts that merge the set one variant at a time at
    the default thread count (``merge_timeline.py``, ``threshold_share.py``): set, variants,
    rounds, commit, CPU, load average before and now, and what was held in memory."""
    return {
        "set": str(folder.name),
        "variants": {v: VARIANTS[v] for v in args.variants},
        "repeats": args.repeats,
        "threads": "the default",
        "commit": _commit(),
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "held_in_memory": held.summary(),
    }


def save_results(path: str | Path, record: dict) -> None:
    """Write a run's record as JSON (its folder made if need be) and say where."""
    results = Path(path)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {results}")


def cpu_description() -> dict:
    """The CPU the run had (``/proc/cpuinfo``'s first entry): its model and which of the vector
    extensions the compiled loops choose between it offers. Machines of the same kind here have
    differed in both (with and without AVX-512), and the loops' cost with them."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {
        "model_name": fields.get("model name"),
        "family_model": f"{fields.get('cpu family')}/{fields.get('model')}",
        "vector": [f for f in ("avx2", "fma", "avx512f", "avx512bw") if f in flags],
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_benchmark(args: argparse.Namespace) -> int:
    shape = {**LLAMA_SHAPE, "num_hidden_layers": args.layers}
    folder = Path(args.cache_dir).resolve() / f"llama-{args.layers}L"  # configs need absolute
    if (
        not (folder / "spec.json").is_file()
        or json.loads((folder / "spec.json").read_text()) != shape
    ):
        print(f"writing synthetic checkpoints to {folder} (once)")
        write_checkpoint_set(folder, shape)
    n_params = sum(torch.Size(s).numel() for _, s in llama_tensors(shape))
    out_bytes = 2 * n_params
    print(f"checkpoints: {folder} ({n_params / 1e9:.3f}B parameters each, bf16)")
    env = tool_env(args.threads)
    work = Path(args.cache_dir).resolve() / "outputs"
    work.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    print(f"load average before: {load_before}")
    warm_up(folder, out_bytes, work)
    compile_sources()
    loops_file = compiled_loops(env)

    models = [folder / n for n in ("base", "expert_0", "expert_1")]
    reclaim = proactive_reclaim()
    held = Resident([] if args.no_hold else [*shard_files(models), *tool_files(env)])
    print(f"machine pages out on its own: {reclaim}; held in memory: {held.summary()}")

    def floor_command(n_inputs: int, mode: str) -> list[str]:
        names = ["expert_0", "expert_1"] if n_inputs == 2 else ["base", "expert_0", "expert_1"]
        cmd = [sys.executable, str(Path(__file__).with_name("io_floor.py")), mode, str(out_bytes)]
        cmd += [str(work / "floor"), *[str(folder / n) for n in names]]
        return cmd

    runs: dict[tuple[str, str], list[Measured]] = {}
    sample = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    diffs: dict[str, float] = {}
    for round_ in range(args.repeats):
        for n_inputs in (2, 3):
            for mode in FLOORS:
                runs.setdefault((f"floor_{mode}_{n_inputs}", "floor"), []).append(
                    run_measured(floor_command(n_inputs, mode), env, warm=models)
                )
        for i, variant in enumerate(args.format_variants if not args.only_floor else []):
            commands = mergekit_format_commands(variant, folder, work, args.threads)
            order = ["mergelab"] if args.skip_mergekit else ["mergelab", "mergekit"]
            if (round_ + i) % 2:
                order.reverse()
            for tool in order:
                cmd, out = commands[tool]
                shutil.rmtree(out, ignore_errors=True)
                result = run_measured(cmd, env, warm=models)
                runs.setdefault((f"format:{variant}", tool), []).append(result)
                print(
                    f"round {round_ + 1} mergekit-format {variant:12s} {tool:9s} "
                    f"{result.wall:7.1f} s {result.rss_mib:7.0f} MiB  cpu {result.cpu:6.1f} s  "
                    f"load {load_average()}",
                    flush=True,
                )
                if not args.keep_outputs:
                    shutil.rmtree(out, ignore_errors=True)
        for i, variant in enumerate(args.variants if not args.only_floor else []):
            ours, out_ours = mergelab_command(variant, folder, work)
            theirs = mergekit_command(variant, folder, work, args.threads)
            if args.skip_mergekit:
                theirs = None
            tools = [("mergelab", ours, out_ours)]
            if theirs is not None:
                tools.append(("mergekit", *theirs))
            if (round_ + i) % 2:
                tools.reverse()
            for tool, cmd, out in tools:
                shutil.rmtree(out, ignore_errors=True)
                result = run_measured(cmd, env, warm=models)
                runs.setdefault((variant, tool), []).append(result)
                print(
                    f"round {round_ + 1} {variant:18s} {tool:9s} {result.wall:7.1f} s "
                    f"{result.rss_mib:7.0f} MiB  cpu {result.cpu:6.1f} s  load {load_average()}",
                    flush=True,
                )
            if theirs is not None and not variant.startswith("dare") and round_ == 0:
                if all(runs[(variant, t)][-1].returncode == 0 for t in ("mergelab", "mergekit")):
                    diffs[variant] = compare_outputs(out_ours, theirs[1], sample)
            for _, _, out in tools:
                if not args.keep_outputs:  # 2 GB each; the inputs stay cached
                    shutil.rmtree(out, ignore_errors=True)
    load_after = load_average()

    def best(key: tuple[str, str]) -> dict | None:
        got = runs.get(key)
        if not got:
            return None
        ok = all(r.returncode == 0 for r in got)
        return {
            "s": min(r.wall for r in got),
            "runs_s": [round(r.wall, 2) for r in got],
            "runs_cpu_s": [round(r.cpu, 2) for r in got],
            "runs_waits_s": [r.waits for r in got],
            "cpu_s": min(r.cpu for r in got),
            "rss_mib": max(r.rss_mib for r in got),
            "ok": ok,
        }

    floors = {
        f"{mode}_{n}_inputs": best((f"floor_{mode}_{n}", "floor"))
        for mode in FLOORS
        for n in (2, 3)
    }
    results = Path(args.results)
    if args.only_floor:  # new floors for the rows already measured
        record = json.loads(results.read_text())
        record["floor"] = floors
        record["config"]["floor_load_average"] = [load_before, load_average()]
        add_ratios(record["rows"], floors)
        results.write_text(json.dumps(record, indent=2) + "\n")
        print_table(record["rows"], floors)
        print(f"\nresults: {results}")
        return 0
    linear = best(("linear", "mergelab"))
    rows = []
    for variant in args.variants:
        row: dict = {"variant": variant, "method": VARIANTS[variant][0]}
        row["mergelab"], row["mergekit"] = best((variant, "mergelab")), best((variant, "mergekit"))
        if row["mergelab"] is not None and linear is not None:
            row["over_linear"] = row["mergelab"]["s"] / linear["s"]
        if row["mergekit"] is not None and row["mergelab"] is not None:
            row["speedup"] = row["mergekit"]["s"] / row["mergelab"]["s"]
            row["rss_ratio"] = row["mergelab"]["rss_mib"] / row["mergekit"]["rss_mib"]
        if variant in diffs:
            row["max_abs_diff_sample"] = diffs[variant]
        rows.append(row)
    add_ratios(rows, floors)
    format_rows = []
    format_linear = best(("format:linear", "mergelab"))
    for variant in args.format_variants:
        ours, theirs = (
            best((f"format:{variant}", "mergelab")),
            best((f"format:{variant}", "mergekit")),
        )
        row = {"variant": variant, "merge_method": MERGEKIT_FORMAT[variant][0]}
        row["mergelab"], row["mergekit"] = ours, theirs
        if ours is not None and format_linear is not None:
            row["over_linear"] = ours["s"] / format_linear["s"]
            row["over_linear_cpu"] = ours["cpu_s"] / format_linear["cpu_s"]
        if ours is not None and theirs is not None:
            row["speedup"] = theirs["s"] / ours["s"]
            row["speedup_cpu"] = theirs["cpu_s"] / ours["cpu_s"]
            row["rss_ratio"] = ours["rss_mib"] / theirs["rss_mib"]
        format_rows.append(row)

    print_format_table(format_rows)
    print_table(rows, floors)
    record = {
        "config": {
            "shape": shape,
            "n_params": n_params,
            "dtype": "bfloat16 stored, float32 compute",
            "threads": args.threads if args.threads is not None else "each tool's default",
            "torch_default_threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "variants": {v: VARIANTS[v] for v in args.variants},
            "mergekit_format": {
                "configs": {v: MERGEKIT_FORMAT[v] for v in args.format_variants},
                "dtype": "bfloat16 compute and storage (each config's dtype)",
                "flags_both_tools": MERGEKIT_FORMAT_FLAGS,
                "flags_mergekit_only": MERGEKIT_ONLY_FLAGS,
            },
            "label": args.label,
            "commit": _commit(),
            "machine": platform.platform(),
            "cpu": cpu_description(),
            "cpu_count": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "compiled_loops": loops_file,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "proactive_reclaim": reclaim,
            "held_in_memory": held.summary(),
        },
        "floor": floors,
        "mergekit_format_rows": format_rows,
        "rows": rows,
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nload average after: {load_after}\nresults: {results}")
    every = rows + format_rows
    return 0 if all((r["mergelab"] or {}).get("ok", True) for r in every) else 1


def add_ratios(rows: list[dict], floors: dict[str, dict]) -> None:
    """Each row's time over the floors of its number of inputs (linear reads two models)."""
    for row in rows:
        n = 2 if row["variant"] == "linear" else 3
        for mode in FLOORS:
            floor = floors.get(f"{mode}_{n}_inputs")
            if row["mergelab"] is not None and floor is not None:
                row[f"over_floor_{mode}"] = row["mergelab"]["s"] / floor["s"]


def print_table(rows: list[dict], floors: dict[str, dict]) -> None:
    def s(x: dict | None, key: str = "s", fmt: str = "{:.1f}") -> str:
        return "–" if x is None else fmt.format(x[key])

    def r(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    print()
    for name, floor in floors.items():
        print(f"floor {name}: {s(floor)} s, {s(floor, 'rss_mib', '{:.0f}')} MiB")
    print(
        f"{'variant':18s} {'mergelab s':>10s} {'mergekit s':>10s} {'speed-up':>9s} "
        f"{'/linear':>8s} {'/floor':>7s} {'/buffered':>9s} {'mergelab MiB':>12s} "
        f"{'mergekit MiB':>12s}"
    )
    for row in rows:
        print(
            f"{row['variant']:18s} {s(row['mergelab']):>10s} {s(row['mergekit']):>10s} "
            f"{r(row.get('speedup')):>9s} {r(row.get('over_linear')):>8s} "
            f"{r(row.get('over_floor_direct')):>7s} {r(row.get('over_floor_buffered')):>9s} "
            f"{s(row['mergelab'], 'rss_mib', '{:.0f}'):>12s} "
            f"{s(row['mergekit'], 'rss_mib', '{:.0f}'):>12s}"
        )


def print_format_table(rows: list[dict]) -> None:
    """The first table: mergekit-format configs (``dtype: bfloat16``), each tool at its defaults."""
    if not rows:
        return

    def s(x: dict | None, key: str = "s", fmt: str = "{:.1f}") -> str:
        return "–" if x is None else fmt.format(x[key])

    def r(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    print("\nmergekit-format configs (dtype: bfloat16), each tool at its defaults")
    print(
        f"{'config':14s} {'mergekit s':>10s} {'mergelab s':>10s} {'ratio':>7s} {'cpu ratio':>9s} "
        f"{'/linear':>8s} {'mergekit MiB':>12s} {'mergelab MiB':>12s}"
    )
    for row in rows:
        print(
            f"{row['variant']:14s} {s(row['mergekit']):>10s} {s(row['mergelab']):>10s} "
            f"{r(row.get('speedup')):>7s} {r(row.get('speedup_cpu')):>9s} "
            f"{r(row.get('over_linear')):>8s} "
            f"{s(row['mergekit'], 'rss_mib', '{:.0f}'):>12s} "
            f"{s(row['mergelab'], 'rss_mib', '{:.0f}'):>12s}"
        )
    print("\nfloat32 compute (each tool's own dialect)")


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
    cmd = ["mergekit-yaml", str(config), str(theirs), *_threads_flag(args.threads), "--quiet"]
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
            "commit": _commit(),
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
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=".cache/merge_speed")
    parser.add_argument(
        "--format-variants",
        nargs="*",
        default=list(MERGEKIT_FORMAT),
        choices=list(MERGEKIT_FORMAT),
        help="the first table's mergekit-format configs (none: the float32 table only)",
    )
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--label", default="", help="a note on this run, kept in the results")
    parser.add_argument(
        "--threads", type=int, help="threads for both tools (default: each tool's own default)"
    )
    parser.add_argument("--layers", type=int, default=LLAMA_SHAPE["num_hidden_layers"])
    parser.add_argument(
        "--results",
        help="JSON results file (default benchmarks/results/merge_speed.json, "
        "merge_speed_threads<N>.json with --threads, merge_speed_config.json with "
        "--mergekit-config)",
    )
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; best time kept")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the merged checkpoints")
    parser.add_argument(
        "--no-hold",
        action="store_true",
        help="do not hold the inputs and the tools' files in memory (see Resident)",
    )
    parser.add_argument(
        "--only-floor",
        action="store_true",
        help="measure only the floors, into the existing --results file (its rows stay)",
    )
    parser.add_argument(
        "--mergekit-config",
        metavar="YAML",
        help="run this mergekit-spelled config with both tools instead (see the module docstring)",
    )
    args = parser.parse_args(argv)
    if args.mergekit_config:
        default_name = "merge_speed_config.json"
    elif args.threads is not None:
        default_name = f"merge_speed_threads{args.threads}.json"
    else:
        default_name = "merge_speed.json"
    args.results = args.results or f"benchmarks/results/{default_name}"
    if args.mergekit_config:
        return run_mergekit_config(args, tool_env(args.threads))
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
