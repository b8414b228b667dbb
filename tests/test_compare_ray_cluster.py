"""`mergelab compare` on Ray as a cluster (slow; run with ``-m slow``): your own data and an
lm-eval task with ``--executor ray`` equal the local run; on a local multi-node cluster (Ray's
``cluster_utils.Cluster``: a head without CPUs and two worker nodes) a worker node killed
mid-run does not stop the comparison, whose outcomes equal the local run's.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import mergelab.compare as mc

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
REPO = str(Path(mc.__file__).parents[2])
RECORDS = [
    {
        "x": f"{a} plus {b} is",
        "y": str(a + b),
        "choices": [str(a + b + d) for d in (1, 0, -1)],
        "label": 1,
    }
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (4, 4), (6, 3), (0, 5), (2, 7), (3, 3)]
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mergelab.tiny import char_tokenizer, tiny_llama

    tok = char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz>", bos=None, unk="<unk>")
    root = tmp_path_factory.mktemp("ray_cluster")
    for i, name in enumerate(("base", "math", "code")):
        m = tiny_llama(tok, hidden_size=32, num_layers=2, seed=0, initializer_range=0.3)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root


def _spec(root: Path, benchmarks: list) -> dict:
    return {
        "name": "ray-cluster",
        "models": {
            "base": str(root / "base"),
            "experts": {"math": str(root / "math"), "code": str(root / "code")},
        },
        "candidates": [
            {"family": "base"},
            {"family": "expert"},
            {"family": "merge", "method": "task_arithmetic", "grid": {"lambda": [0.5, 1.0]}},
        ],
        "benchmarks": benchmarks,
        "generation": {"max_new_tokens": 4, "batch_size": 8},
        "statistics": {"bootstrap_samples": 200},
    }


OWN = [
    {
        "name": "mc",
        "file": "sums.jsonl",
        "task": "multiple_choice",
        "fields": {"prompt": "{x}", "choices": "choices", "label": "label"},
        "split": {"validation": 4, "test": "rest"},
    },
    {
        "name": "em",
        "file": "sums.jsonl",
        "task": "exact_match",
        "fields": {"prompt": "{x}>", "target": "{y}"},
        "validation_from": "mc",
    },
]


def _outcomes(results: dict) -> list:
    runs = [{k: v for k, v in r.items() if k != "cost"} for r in results["runs"]]
    return [runs, results["choices"], results["splits"], results["statistics"]]


def _write(root: Path, spec: dict, name: str) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_own_data_and_an_lm_eval_task_on_ray_equal_the_local_run(world, tmp_path):
    pytest.importorskip("lm_eval")
    from test_compare_lm_eval import _task_folder

    tasks = _task_folder(tmp_path)
    benchmarks = [
        *OWN,
        {
            "name": "lm",
            "lm_eval": {"task": "mergelab_own_mc", "include_path": str(tasks)},
            "validation_from": "mc",
        },
    ]
    path = _write(world, _spec(world, benchmarks), "own_and_lm_eval.yaml")
    local = mc.run(path, cache_dir=tmp_path / "local", progress=False)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO}},
    )
    try:
        remote = mc.run(path, cache_dir=tmp_path / "ray", executor="ray", progress=False)
    finally:
        ray.shutdown()
    assert _outcomes(remote) == _outcomes(local)
    assert {r["benchmark"] for r in remote["runs"]} == {"mc", "em", "lm"}


def test_a_worker_node_killed_mid_run_on_a_multi_node_cluster(world, tmp_path):
    from ray.cluster_utils import Cluster

    path = _write(world, _spec(world, OWN), "own.yaml")
    local = mc.run(path, cache_dir=tmp_path / "local", progress=False)
    n_jobs = len(local["runs"])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},  # jobs go to the workers
    )
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(
        address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": REPO}}
    )
    out: dict = {}

    def compare():
        try:
            out["results"] = mc.run(
                path,
                cache_dir=tmp_path / "cluster",
                executor={"kind": "ray", "address": cluster.address, "num_cpus": 1},
                progress=False,
            )
        except BaseException as exc:  # reported by the main thread
            out["error"] = exc

    thread = threading.Thread(target=compare)
    try:
        thread.start()
        jobs = tmp_path / "cluster" / "jobs"
        deadline = time.time() + 300
        while time.time() < deadline and len(list(jobs.glob("*.json"))) < 2:
            time.sleep(0.2)
        done_at_kill = len(list(jobs.glob("*.json")))
        cluster.remove_node(workers[0])  # kills its raylet and the jobs running there
        thread.join(timeout=600)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert 2 <= done_at_kill < n_jobs  # the node died mid-run
    assert "error" not in out, out.get("error")
    assert _outcomes(out["results"]) == _outcomes(local)
    assert len(list((tmp_path / "cluster" / "jobs").glob("*.json"))) == n_jobs
