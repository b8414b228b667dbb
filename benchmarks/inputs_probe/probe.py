"""Every bad-input / environment-fault case of issue 50 item 5 and issue 53 item 4, run as a user
runs it: one JSON line per case with the exit code, the seconds and the last stderr lines.
``results/inputs/probe_before.jsonl`` (ce16c97) and ``probe_after.jsonl`` hold its output.

    python benchmarks/inputs_probe/make_models.py
    mount -t tmpfs -o size=16k tmpfs /tmp/inputs_probe/full   # as root: the full disk
    PROBE_MOD=mergelab python benchmarks/inputs_probe/probe.py REPO [CASE ...]

REPO is the tree to import mergelab from (PYTHONPATH); PROBE_MOD the module run with -m
(``mergelab.cli`` for trees without ``mergelab/__main__.py``). ``eval_data_dev_zero`` and the
other /dev/zero cases run under a 6 GB address-space limit, so the old behaviour ends in a
MemoryError instead of filling the machine.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

WT = sys.argv[1]
only = sys.argv[2:]
P = "/tmp/inputs_probe"
M = f"{P}/m"
py = [sys.executable, "-m", os.environ.get("PROBE_MOD", "mergelab.cli")]
br = [sys.executable, "-m", "mergelab.eval.lm_eval_bridge"]


def out(name):
    p = f"{P}/out/{name}"
    shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(p + ".cache", ignore_errors=True)
    return p


os.makedirs(f"{P}/out", exist_ok=True)
lm = [
    "run",
    "--model",
    "mergelab",
    "--tasks",
    "mergelab_tiny_mc",
    "--include_path",
    f"{WT}/tests/fixtures/lm_eval",
]
CASES = {
    "merge_perm_tokenizer": py
    + [
        "merge",
        "--method",
        "linear",
        "--models",
        f"{M}/math",
        f"{M}/perm",
        "--out",
        out("perm"),
        "--no-progress",
    ],
    "merge_perm_tokenizer_mergekit": py
    + ["merge", "--config", f"{P}/mk_perm.yaml", "--out", out("perm_mk"), "--no-progress"],
    "eval_data_dev_zero": ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x"]
    + py
    + [
        "eval",
        "run",
        "--model",
        f"{M}/base",
        "--benchmark",
        "gsm8k",
        "--data",
        "/dev/zero",
        "--out",
        out("ez"),
        "--cache-dir",
        f"{P}/out/ezc",
    ],
    "eval_data_fifo": py
    + [
        "eval",
        "run",
        "--model",
        f"{M}/base",
        "--benchmark",
        "gsm8k",
        "--data",
        f"{P}/fifo",
        "--out",
        out("ef"),
        "--cache-dir",
        f"{P}/out/efc",
    ],
    "merge_config_dev_zero": ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x"]
    + py
    + ["merge", "--config", "/dev/zero", "--out", out("mz")],
    "merge_config_fifo": py + ["merge", "--config", f"{P}/fifo", "--out", out("mf")],
    "compare_spec_fifo": py + ["compare", f"{P}/fifo", "--out", out("cf"), "--dry-run"],
    "compare_spec_dev_zero": ["bash", "-c", 'ulimit -v 6000000; exec "$@"', "x"]
    + py
    + ["compare", "/dev/zero", "--out", out("cz"), "--dry-run"],
    "compose_prompts_fifo": py
    + ["compose", "--base", f"{M}/base", "--expert", f"{M}/math", "--prompts-file", f"{P}/fifo"],
    "eval_spec_fifo": py
    + [
        "eval",
        "run",
        "--spec",
        f"{P}/fifo",
        "--benchmark",
        "gsm8k",
        "--data",
        f"{P}/fifo",
        "--out",
        out("esf"),
        "--cache-dir",
        f"{P}/out/esfc",
    ],
    "merge_full_disk": py
    + [
        "merge",
        "--method",
        "linear",
        "--models",
        f"{M}/math",
        f"{M}/code",
        "--out",
        f"{P}/full/o",
        "--no-progress",
    ],
    "deep_model_config_json": py
    + [
        "merge",
        "--method",
        "linear",
        "--models",
        f"{M}/math",
        f"{P}/m_deep",
        "--out",
        out("deep"),
        "--no-progress",
    ],
    "deep_merge_yaml": py + ["merge", "--config", f"{P}/deep.yaml", "--out", out("deepy")],
    "deep_compare_yaml": py
    + ["compare", f"{P}/deep_spec.yaml", "--out", out("deepc"), "--dry-run"],
    "compose_lora_other_base": py
    + [
        "compose",
        "--base",
        f"{M}/base",
        "--expert",
        f"{M}/lora_other",
        "--lora",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "2",
    ],
    "compose_adapter_without_lora": py
    + [
        "compose",
        "--base",
        f"{M}/base",
        "--expert",
        f"{M}/lora",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "2",
    ],
    "compare_out_equals_cache": py
    + [
        "compare",
        "--example",
        "tiny",
        "--out",
        out("same"),
        "--cache",
        f"{P}/out/same",
        "--no-progress",
    ],
    "lm_eval_missing_spec": br + lm + ["--model_args", f"spec={P}/nope.yaml"],
    "lm_eval_unknown_key": br + lm + ["--model_args", f"spec={P}/spec_base.yaml,colour=red"],
    "lm_eval_batch_size": br + lm + ["--model_args", f"spec={P}/spec_base.yaml,batch_size=4"],
    "lm_eval_bad_dtype": br + lm + ["--model_args", f"spec={P}/spec_base.yaml,dtype=float8"],
    "lm_eval_pretrained": br + lm + ["--model_args", f"pretrained={M}/base"],
    "lm_eval_help_mentions_spec": ["bash", "-c", "\"$@\" --help | grep -c 'spec='", "x"]
    + br
    + ["run"],
}
TIMEOUT = {
    "eval_data_fifo": 40,
    "merge_config_fifo": 40,
    "compare_spec_fifo": 40,
    "compose_prompts_fifo": 40,
    "eval_spec_fifo": 40,
}
env = {**os.environ, "PYTHONPATH": WT, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
env.pop("MERGELAB_DEBUG", None)


def dfl():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell ignores SIGINT


def run_case(name, argv):
    t = time.time()
    try:
        p = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT.get(name, 400),
            cwd=WT if name.startswith("lm_eval") else P,
            preexec_fn=dfl,
        )
        rc, err = p.returncode, (p.stderr.strip().splitlines() or [""])
        tail = [line for line in err if line.strip()][-3:]
        if name.endswith("help_mentions_spec"):
            tail = [p.stdout.strip()]
    except subprocess.TimeoutExpired:
        rc, tail = "TIMEOUT", []
    return {
        "case": name,
        "rc": rc,
        "s": round(time.time() - t, 1),
        "tail": [line[:300] for line in tail],
    }


for name, argv in CASES.items():
    if only and name not in only:
        continue
    r = run_case(name, argv)
    print(json.dumps(r), flush=True)
# SIGINT at start-up
if not only or "sigint" in only:
    for delay in (0.05, 0.2, 0.5, 1.0, 2.0, 4.0):
        p = subprocess.Popen(
            py
            + [
                "merge",
                "--method",
                "linear",
                "--models",
                f"{M}/math",
                f"{M}/code",
                "--out",
                out("int"),
                "--no-progress",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=P,
            preexec_fn=dfl,
        )
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
        lines = [line for line in err.strip().splitlines() if line.strip()]
        print(
            json.dumps(
                {
                    "case": f"sigint_at_{delay}s",
                    "rc": p.returncode,
                    "traceback": "Traceback" in err,
                    "lines": len(lines),
                    "tail": lines[-1:],
                }
            ),
            flush=True,
        )
