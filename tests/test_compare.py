"""mergelab.compare: spec errors, selection on validation only, resume after a kill, the Ray
executor against the local one, and the statistics against hand-computed values.

The models are tiny random Llamas (the experts are the base plus seeded noise); benchmark
answers are taken from the candidates' own greedy outputs so that scores differ between
candidates and grid points (a test of "the choice did not change" must be able to fail).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import mergelab.compare as mc
from mergelab.cli import main as cli_main
from mergelab.compare.statistics import seed_interval
from mergelab.eval.stats import bootstrap_ci, mcnemar_exact, paired_bootstrap, paired_comparison

N_ITEMS = 24
GEN = {"max_new_tokens": 6, "batch_size": 12}


def _tokenizer():
    """Digits, space and newline; every other character is <unk>: outputs are mostly numbers."""
    from mergelab.tiny import char_tokenizer

    return char_tokenizer("0123456789 \n", bos=None, unk="<unk>", padding_side="left")


def _models():
    from mergelab.tiny import tiny_llama

    tok = _tokenizer()
    base = tiny_llama(tok, hidden_size=32, num_layers=2, seed=0, initializer_range=0.3)
    experts = {}
    for i, name in enumerate(("math", "code")):
        m = tiny_llama(tok, hidden_size=32, num_layers=2, seed=0, initializer_range=0.3)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        experts[name] = m
    return tok, base, experts


def _last_number(text: str) -> str | None:
    import re

    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def _outputs(model, tok, bench, seed: int = 0) -> dict[str, str]:
    """Greedy outputs of ``model`` on ``bench`` through the harness (as compare builds them)."""
    from mergelab import ModelCandidate
    from mergelab.compare.spec import eval_settings_for

    settings = eval_settings_for(
        GEN, {"n_shots": 0}, {}, seed=seed, bootstrap_samples=100, confidence=0.95
    )
    gens = ModelCandidate(model, tok, name="probe").generate(
        [_prompt(it, bench, settings, tok) for it in bench.items],
        settings.generation,
    )
    return {it.item_id: g.text for it, g in zip(bench.items, gens)}


def _prompt(item, bench, settings, tok):
    from mergelab.eval.prompts import build_prompt

    return build_prompt(item, bench, settings.prompt, tok)


def _bench(answers: dict[str, str] | None = None, name: str = "arith"):
    from mergelab.eval.benchmarks import Benchmark, Item

    items = [
        Item(f"q{i}", f"what is {i} plus {i % 7}?", answer=(answers or {}).get(f"q{i}", "-1"))
        for i in range(N_ITEMS)
    ]
    return Benchmark.from_items(name, "gsm8k", items)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny models (objects and saved folders) and a benchmark the math expert half solves."""
    tok, base, experts = _models()
    root = tmp_path_factory.mktemp("compare")
    for name, model in {"base": base, **experts}.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    probe = _bench()
    math_out = _outputs(experts["math"], tok, probe)
    answers = {i: (_last_number(t) or "-1") for i, t in math_out.items()}
    bench = _bench(answers)
    with open(root / "arith.jsonl", "w") as f:
        for it in bench.items:
            f.write(
                json.dumps({"item_id": it.item_id, "prompt": it.prompt, "answer": it.answer}) + "\n"
            )
    return {"tok": tok, "base": base, "experts": experts, "root": root, "bench": bench}


def _spec_dict(world, **over):
    spec = {
        "models": {
            "base": world["base"],
            "tokenizer": world["tok"],
            "experts": dict(world["experts"]),
        },
        "candidates": [
            {"family": "base"},
            {"family": "expert"},
            {"family": "composition", "grid": {"weight": [0.5, 1.0]}},
            {"family": "merge", "method": "task_arithmetic", "grid": {"lambda": [0.3, 0.6, 1.0]}},
        ],
        "benchmarks": [
            {
                "name": "arith",
                "benchmark": world["bench"],
                "split": {"validation": 10, "test": 14},
                "generation": GEN,
                "prompt": {"n_shots": 0},
                "baselines": {},
            }
        ],
        "statistics": {"bootstrap_samples": 200},
    }
    spec.update(over)
    return spec


def _yaml_spec(world, path: Path, **over) -> Path:
    root = world["root"]
    spec = {
        "name": "tiny-test",
        "models": {
            "base": str(root / "base"),
            "experts": {"math": str(root / "math"), "code": str(root / "code")},
        },
        "candidates": [
            {"family": "base"},
            {"family": "expert"},
            {"family": "composition", "grid": {"weight": [0.5, 1.0]}},
            {"family": "merge", "method": "task_arithmetic", "grid": {"lambda": [0.5, 1.0]}},
        ],
        "benchmarks": [
            {
                "name": "arith",
                "file": str(root / "arith.jsonl"),
                "task": "gsm8k",
                "split": {"validation": 10, "test": 14},
                "generation": GEN,
                "prompt": {"n_shots": 0},
                "baselines": [],
            }
        ],
        "statistics": {"bootstrap_samples": 200},
    }
    spec.update(over)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _outcomes(results: dict) -> list:
    """Everything a run decides, without wall-clock costs."""
    runs = [{k: v for k, v in r.items() if k not in ("cost",)} for r in results["runs"]]
    return [runs, results["choices"], results["splits"], results["statistics"]]


# ----------------------------------------------------------------------------------------------
# Spec errors


@pytest.mark.parametrize(
    "change, key, words",
    [
        (lambda s: s.update(candidatez=[]), "candidatez", "unknown key"),
        (lambda s: s["candidates"][3].update(lamda=[1]), "candidates[3].lamda", "unknown key"),
        (
            lambda s: s["candidates"][3].update(grid={"lambdaa": [0.5]}),
            "candidates[3].grid",
            "no parameter",
        ),
        (
            lambda s: s["candidates"][3].update(method="ties", grid={"density": [0.5, 1.5]}),
            "candidates[3].grid (density=1.5)",
            "density",
        ),
        (
            lambda s: s["candidates"][3].update(grid={"lambda": []}),
            "candidates[3].grid.lambda",
            "empty",
        ),
        (
            lambda s: s["candidates"][3].update(grid={"lambda": [0.5, 0.5]}),
            "candidates[3].grid.lambda",
            "twice",
        ),
        (
            lambda s: s["candidates"][2].update(grid={"weight": [float("nan")]}),
            "candidates[2].grid.weight",
            "finite",
        ),
        (
            lambda s: s["candidates"][2].update(grid={"eos_policy": ["sometimes"]}),
            "candidates[2].eos_policy",
            "sometimes",
        ),
        (
            lambda s: s["candidates"][2].update(experts=["math", "physics"]),
            "candidates[2].experts",
            "physics",
        ),
        (
            lambda s: s["benchmarks"][0].update(
                split={"validation": ["q1", "q2"], "test": ["q2", "q3"]}
            ),
            "benchmarks[0].split",
            "share 1 item",
        ),
        (
            lambda s: s["benchmarks"][0].update(split={"validation": 10, "tset": 5}),
            "benchmarks[0].split.tset",
            "unknown key",
        ),
        (lambda s: s.update(selection={"metric": "nope"}), "selection.metric", "nope"),
        (lambda s: s.update(seeds=[0, 0]), "seeds", "twice"),
        (
            lambda s: s["benchmarks"][0]["generation"].update(max_new_tokens=0),
            "benchmarks[0].generation",
            "max_new_tokens",
        ),
    ],
)
def test_spec_errors_name_the_key_and_file(world, tmp_path, change, key, words):
    path = _yaml_spec(world, tmp_path / "spec.yaml")
    spec = yaml.safe_load(path.read_text())
    spec["benchmarks"][0]["generation"] = dict(GEN)
    change(spec)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(mc.SpecError) as err:
        mc.load_spec(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {key}"), msg
    assert words in msg, msg


def test_splits_resolved_per_seed_never_overlap_and_too_many_items_refused(world, tmp_path):
    spec = mc.load_spec(_spec_dict(world, seeds=[0, 1]))
    plan = mc.make_plan(spec)
    for seed in (0, 1):
        sp = plan.splits[seed]["arith"]
        assert len(sp["validation"]) == 10 and len(sp["test"]) == 14
        assert not set(sp["validation"]) & set(sp["test"])
    assert plan.splits[0]["arith"] != plan.splits[1]["arith"]  # a seeded split per seed
    bad = _spec_dict(world)
    bad["benchmarks"][0]["split"] = {"validation": 20, "test": 20}
    with pytest.raises(mc.SpecError, match=r"benchmarks\[arith\].split.test: 20 items asked, 4"):
        mc.make_plan(mc.load_spec(bad))
    bad["benchmarks"][0]["split"] = {"validation": ["q1", "nope"]}
    with pytest.raises(mc.SpecError, match="not in benchmark"):
        mc.make_plan(mc.load_spec(bad))


def test_cli_spec_error_exits_2_with_one_line(world, tmp_path, capsys):
    path = _yaml_spec(world, tmp_path / "spec.yaml", candidatez=[])
    assert cli_main(["compare", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mergelab compare: error: ") and "candidatez" in err and str(path) in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# Selection reads validation only


def test_selection_never_reads_test_items(world, tmp_path):
    """Two runs whose test answers are made from two different grid points' outputs (each
    grid point is then "perfect" on test in one run): the choices must not move, while the
    test scores do (so the poison reached the test split)."""
    from mergelab.merge import merge_models

    tok, base, experts = world["tok"], world["base"], world["experts"]
    plan = mc.make_plan(mc.load_spec(_spec_dict(world)))
    test_ids = set(plan.splits[0]["arith"]["test"])
    probe = _bench()

    def answers_from(model):
        out = _outputs(model, tok, probe)
        return {i: (_last_number(t) or "-1") for i, t in out.items()}

    val_answers = {i: a for i, a in world_answers(world).items() if i not in test_ids}
    results = []
    for lam in (0.3, 1.0):
        merged = merge_models(
            "task_arithmetic", base, list(experts.values()), params={"lambda": lam}
        )
        poisoned = {**answers_from(merged), **val_answers}  # test answers: this point's outputs
        spec = _spec_dict(world)
        spec["benchmarks"][0]["benchmark"] = _bench(poisoned)
        results.append(mc.run(spec, cache_dir=tmp_path / f"cache{lam}", progress=False))
    a, b = results
    assert a["choices"] == b["choices"]
    assert a["splits"] == b["splits"]
    val_a = [r for r in a["runs"] if r["split"] == "validation"]
    val_b = [r for r in b["runs"] if r["split"] == "validation"]
    assert val_a == [dict(r, cost=x["cost"]) for r, x in zip(val_b, val_a)]
    sa = a["statistics"]["per_seed"]["0"]["arith"]["scores"]
    sb = b["statistics"]["per_seed"]["0"]["arith"]["scores"]
    assert any(sa[r]["mean"] != sb[r]["mean"] for r in sa)  # the poison changed test scores
    # every validation score was recorded for every grid point
    fam = a["choices"]["0"]["families"]["task_arithmetic"]
    assert set(fam["validation"]) == {"lambda=0.3", "lambda=0.6", "lambda=1.0"}
    assert fam["chosen"] in fam["tied"] and fam["validation"][fam["chosen"]] == max(
        fam["validation"].values()
    )


def world_answers(world) -> dict[str, str]:
    return {it.item_id: it.answer for it in world["bench"].items}


def test_tie_break_rules(world):
    from mergelab.compare.plan import Point
    from mergelab.compare.select import choose_point

    spec = mc.load_spec(_spec_dict(world))
    fam = next(f for f in spec.families if f.name == "task_arithmetic")
    fam = type(fam)(**{**fam.__dict__, "prefer": {"lambda": 0.7}})
    points = [Point(fam, fam.name, p) for p in fam.points()]
    recs = [
        {"row": p.row, "label": p.label, "benchmark": "arith", "split": "validation", "mean": m}
        for p, m in zip(points, [0.5, 0.25, 0.5])
    ]
    pick = lambda rule: choose_point(points, recs, "mean", ["arith"], rule)["chosen"]  # noqa: E731
    assert pick("first") == "lambda=0.3" and pick("last") == "lambda=1.0"
    assert pick("closest") == "lambda=1.0"  # |1.0 − 0.7| < |0.3 − 0.7|
    with pytest.raises(ValueError, match="not from a validation split"):
        choose_point(points, [dict(recs[0], split="test")], "mean", ["arith"], "first")


# ----------------------------------------------------------------------------------------------
# Outputs, dry run, plot-only, resume


def test_cli_run_dry_run_plot_only_and_force(world, tmp_path, capsys):
    path = _yaml_spec(world, tmp_path / "spec.yaml")
    assert cli_main(["compare", str(path), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    # validation: (2 experts + 2 composition + 2 task arithmetic points) × 10 items;
    # test: (base + 2 experts + composition + task arithmetic) × 14 items
    assert "6 validation jobs (60 generations), 5 test jobs (70 generations)" in plan
    out = tmp_path / "out"
    assert cli_main(["compare", str(path), "--out", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    results = mc.load_results(out / "results.json")
    assert (out / "figures" / "scores.png").is_file() and (
        out / "figures" / "score_vs_cost.png"
    ).is_file()
    stats = results["statistics"]["per_seed"]["0"]["arith"]
    for r in results["runs"]:  # each score is the mean of its recorded per-item outcomes
        assert r["mean"] == pytest.approx(sum(r["items"].values()) / len(r["items"]))
        if r["split"] == "test":
            assert stats["scores"][r["row"]]["mean"] == pytest.approx(r["mean"])
    math_score = stats["scores"]["math"]
    assert f"| math | expert | – | {100 * math_score['mean']:.1f} [" in table
    # plot-only draws from results.json alone
    results["name"] = "renamed in the file"
    (out / "results.json").write_text(json.dumps(results))
    assert cli_main(["compare", "--plot-only", "--out", str(out)]) == 0
    assert (out / "table.md").read_text().startswith("# renamed in the file")
    # an existing output needs --force; a folder mergelab did not write is never replaced
    assert cli_main(["compare", str(path), "--out", str(out), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert cli_main(["compare", str(path), "--out", str(foreign), "--force"]) == 2
    assert (foreign / "notes.txt").read_text() == "mine"


def test_resume_after_kill_equals_uninterrupted_run(world, tmp_path):
    path = _yaml_spec(world, tmp_path / "spec.yaml")
    cmd = [
        sys.executable,
        "-m",
        "mergelab.cli",
        "compare",
        str(path),
        "--no-progress",
        "--threads",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(mc.__file__).parents[2])}
    killed_cache = tmp_path / "a.cache"
    proc = subprocess.Popen(
        cmd + ["--out", str(tmp_path / "a"), "--cache", str(killed_cache)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    jobs = killed_cache / "jobs"
    while time.time() < deadline and proc.poll() is None:
        if jobs.is_dir() and len(list(jobs.glob("*.json"))) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list(jobs.glob("*.json")))
    assert 3 <= finished < 11 and not (tmp_path / "a").exists()
    done = subprocess.run(
        cmd + ["--out", str(tmp_path / "a"), "--cache", str(killed_cache)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    mc.run(path, tmp_path / "b", progress=False)  # uninterrupted, in a cache of its own
    a = mc.load_results(tmp_path / "a" / "results.json")
    b = mc.load_results(tmp_path / "b" / "results.json")
    assert _outcomes(a) == _outcomes(b)
    assert a["statistics"] == b["statistics"] and a["choices"] == b["choices"]


def test_a_job_read_back_presents_its_items_in_the_split_order():
    from mergelab.compare.executors import in_split_order

    stored = {"row": "x", "items": {"a": 1.0, "b": 0.0, "c": 1.0}}  # as a sorted file holds them
    read = in_split_order(stored, ["c", "a", "b"])
    assert list(read["items"]) == ["c", "a", "b"] and read["items"]["b"] == 0.0
    assert read["row"] == "x" and list(stored["items"]) == ["a", "b", "c"]  # input untouched


# ----------------------------------------------------------------------------------------------
# Ray == local


def test_ray_executor_equals_local(world, tmp_path):
    ray = pytest.importorskip("ray")
    path = _yaml_spec(world, tmp_path / "spec.yaml")
    local = mc.run(path, cache_dir=tmp_path / "local", progress=False)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(mc.__file__).parents[2])}},
    )
    try:
        remote = mc.run(
            path,
            cache_dir=tmp_path / "ray",
            executor={"kind": "ray", "num_cpus": 1},
            progress=False,
        )
    finally:
        ray.shutdown()
    assert remote["executor"]["kind"] == "ray"
    assert _outcomes(remote) == _outcomes(local)
    assert len(list((tmp_path / "ray" / "jobs").glob("*.json"))) == 11  # every job ran there


# ----------------------------------------------------------------------------------------------
# Statistics against hand-computed values


def test_mcnemar_exact_hand_computed():
    # 3 items only a gets right, none only b: p = 2 · (1/2)^3 = 0.25
    r = mcnemar_exact([1, 1, 1, 0, 1], [0, 0, 0, 0, 1])
    assert (r["a_only"], r["b_only"], r["both"], r["neither"]) == (3, 0, 1, 1)
    assert r["p_value"] == pytest.approx(0.25)
    # 5 vs 1 discordant: p = 2 · P(X ≤ 1 | n=6, 1/2) = 2 · 7/64
    r = mcnemar_exact([1] * 5 + [0] + [1] * 4, [0] * 5 + [1] + [1] * 4)
    assert r["p_value"] == pytest.approx(14 / 64)
    assert mcnemar_exact([1, 0], [1, 0])["p_value"] == 1.0  # no discordant pair


def test_bootstrap_hand_computed():
    # two items 0 and 1: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% quantiles are 0 and 1
    ci = bootstrap_ci([0.0, 1.0], n_boot=20_000, seed=3)
    assert (ci["mean"], ci["low"], ci["high"]) == (0.5, 0.0, 1.0)
    assert bootstrap_ci([0.7] * 9, n_boot=500)["low"] == pytest.approx(0.7)
    # paired: a − b is 1 on one item of four and 0 elsewhere → mean 0.25; P(resampled mean = 0)
    # = (3/4)^4 ≈ 0.316 > 2.5%, so the CI starts at 0; the max 1 has probability 1/256 < 2.5%
    pb = paired_bootstrap([1, 1, 0, 0], [0, 1, 0, 0], n_boot=20_000, seed=1)
    assert pb["mean_diff"] == 0.25 and pb["low"] == 0.0 and pb["high"] == pytest.approx(0.75)
    # binary outcomes → the reported p is McNemar's; otherwise the bootstrap's
    r = paired_comparison({"x": 1.0, "y": 1.0, "z": 0.0}, {"x": 0.0, "y": 0.0, "z": 0.0}, 500)
    assert r["p_value_kind"].startswith("exact McNemar") and r["p_value"] == pytest.approx(0.5)
    r = paired_comparison({"x": 0.5, "y": 1.0}, {"x": 0.0, "y": 0.0}, 500)
    assert r["p_value_kind"].startswith("paired bootstrap") and "mcnemar" not in r


def test_seed_level_interval_hand_computed():
    # mean 0.4, sd 0.2, n 3: half width t(0.975, 2) · 0.2 / √3 = 4.302653 · 0.11547 = 0.496827
    r = seed_interval([0.2, 0.4, 0.6], "t", 0.95)
    assert r["mean"] == pytest.approx(0.4)
    assert (r["low"], r["high"]) == (
        pytest.approx(0.4 - 0.496827, abs=1e-6),
        pytest.approx(0.4 + 0.496827, abs=1e-6),
    )
    assert r["values"] == [0.2, 0.4, 0.6] and "Student-t" in r["description"]
    assert seed_interval([0.3], "t", 0.95)["low"] is None
    # the percentile interval is the items' bootstrap with the seeds as the items
    r = seed_interval([0.2, 0.4, 0.6, 0.5], "percentile", 0.9, seed=4)
    ci = bootstrap_ci([0.2, 0.4, 0.6, 0.5], 10_000, 0.9, 4)
    assert (r["low"], r["high"]) == (ci["low"], ci["high"]) and r["low"] < 0.425 < r["high"]


def test_table_shows_the_holm_adjusted_p_of_each_row_against_the_best_expert():
    from mergelab.compare.statistics import per_seed_statistics

    items = [f"i{k}" for k in range(12)]
    outcome = lambda wins: {i: float(k < wins) for k, i in enumerate(items)}  # noqa: E731
    test = {"arith": {"expert": outcome(0), "a": outcome(6), "b": outcome(5), "c": outcome(1)}}
    stats = per_seed_statistics(test, {"arith": "expert"}, n_boot=200, confidence=0.95, seed=0)
    vs = stats["arith"]["vs_best_expert"]
    # raw p: 2·0.5⁶, 2·0.5⁵, 1; Holm: ×3, ×2 (kept non-decreasing), ×1
    assert [vs[r]["p_value"] for r in "abc"] == pytest.approx([2 / 64, 2 / 32, 1.0])
    assert [vs[r]["p_holm"] for r in "abc"] == pytest.approx([6 / 64, 4 / 32, 1.0])
    data = {
        "name": "holm",
        "seeds": [0],
        "benchmarks": {"arith": {}},
        "rows": [
            {"row": r, "family": "expert" if r == "expert" else "merge"} for r in test["arith"]
        ],
        "choices": {"0": {"families": {}}},
        "costs": {},
        "statistics": {
            "per_seed": {"0": stats},
            "across_seeds": None,
            "confidence": 0.95,
            "bootstrap_samples": 200,
        },
    }
    table = mc.markdown_table(data)
    assert "| p | p Holm |" in table and "rows against the best expert" in table
    header = next(line for line in table.splitlines() if "| p Holm |" in line).split(" | ")
    row_a = next(line for line in table.splitlines() if line.startswith("| a |")).split(" | ")
    assert [row_a[header.index("p")], row_a[header.index("p Holm")]] == ["0.031", "0.094"]


def test_several_seeds_report_per_seed_values_and_a_seed_interval(world, tmp_path):
    spec = _spec_dict(world, seeds=[0, 1])
    spec["candidates"] = spec["candidates"][:2]
    res = mc.run(spec, cache_dir=tmp_path / "c", progress=False)
    across = res["statistics"]["across_seeds"]
    assert across["kind"] == "t"
    for row, entry in across["benchmarks"]["arith"]["scores"].items():
        per_seed = [
            res["statistics"]["per_seed"][s]["arith"]["scores"][row]["mean"] for s in ("0", "1")
        ]
        assert entry["values"] == per_seed
    table = mc.markdown_table(res)
    assert "Student-t interval over seeds" in table and "2 seeds" in table


def test_example_spec_file_is_the_builtin_one():
    from mergelab.compare.example import spec_text

    example = Path(__file__).parents[1] / "examples" / "compare_tiny.yaml"
    assert example.read_text() == spec_text()


# ----------------------------------------------------------------------------------------------
# LoRA experts, streamed merges, accelerate loading


def _lora_adapters(world, root: Path) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, name in enumerate(("math_lora", "code_lora")):
        import copy

        model = get_peft_model(
            copy.deepcopy(world["base"]),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        )
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:  # PEFT starts B at zero: give the adapter an effect
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def test_lora_families_and_adapter_experts(world, tmp_path):
    adapters = _lora_adapters(world, tmp_path)
    root = world["root"]
    spec = yaml.safe_load(_yaml_spec(world, tmp_path / "s.yaml").read_text())
    spec["models"]["experts"] = {n: {"adapter": str(p)} for n, p in adapters.items()}
    spec["candidates"] = [
        {"family": "base"},
        {"family": "expert"},
        {"family": "lora_composition", "grid": {"weight": [0.5, 1.0]}},
        {"family": "lora_merge", "method": "task_arithmetic", "grid": {"lambda": [0.5, 1.0]}},
    ]
    spec["models"]["base"] = str(root / "base")
    res = mc.run(mc.parse_spec(spec, source="lora"), cache_dir=tmp_path / "c", progress=False)
    rows = [r["row"] for r in res["rows"]]
    # a merge family's row is named after its method unless it has a `name`
    assert rows == ["base", "math_lora", "code_lora", "lora_composition", "task_arithmetic"]
    cost = res["costs"]
    assert cost["lora_composition"]["arith"]["model_evaluations_per_token"] == 3
    assert cost["task_arithmetic"]["arith"]["model_evaluations_per_token"] == 1
    assert len(list((tmp_path / "c" / "merges").iterdir())) == 2  # one folder per λ, on disk
    # a LoRA family over full models is refused, naming the key
    spec["models"]["experts"]["full"] = str(root / "math")
    spec["candidates"][2]["experts"] = ["math_lora", "full"]
    with pytest.raises(mc.SpecError, match=r"candidates\[2\].experts: lora_composition needs"):
        mc.parse_spec(spec, source="lora")


def test_lora_merge_of_an_in_memory_base_equals_the_one_from_its_folder(world, tmp_path):
    adapters = _lora_adapters(world, tmp_path)
    family = {
        "family": "lora_merge",
        "name": "merged",
        "method": "task_arithmetic",
        "params": {"lambda": 1.0},
    }
    outputs = []
    for base in (world["base"], str(world["root"] / "base")):
        spec = _spec_dict(
            world,
            models={
                "base": base,
                "tokenizer": world["tok"],
                "experts": {n: {"adapter": str(p)} for n, p in adapters.items()},
            },
            candidates=[{"family": "base"}, family],
        )
        cache = tmp_path / f"c{len(outputs)}"
        res = mc.run(spec, cache_dir=cache, progress=False)
        merged = [r for r in res["runs"] if r["row"] == "merged"]
        outputs.append([(r["items"], r["completions_sha256"]) for r in merged])
        (folder,) = (cache / "merges").iterdir()
        from safetensors.torch import load_file

        tensors = {}
        for shard in sorted(folder.glob("*.safetensors")):
            tensors.update({k: v.tolist() for k, v in load_file(shard).items()})
        outputs[-1].append(tensors)
    # the in-memory base was saved once into the cache and merged from there
    assert len(list(tmp_path.glob("c0/base-*/config.json"))) == 1
    assert not list(tmp_path.glob("c1/base-*"))
    assert outputs[0] == outputs[1]


def test_expert_rows_outside_the_best_expert_choice(world, tmp_path):
    spec = _spec_dict(
        world,
        models={
            "base": world["base"],
            "tokenizer": world["tok"],
            "experts": {**world["experts"], "extra": world["experts"]["math"]},
        },
        candidates=[
            {"family": "base"},
            {"family": "expert", "experts": ["code", "math"]},
            {"family": "composition", "experts": ["math", "code"]},
            {"family": "expert", "name": "rows_only", "experts": ["extra"], "best_expert": False},
        ],
    )
    res = mc.run(spec, cache_dir=tmp_path / "c", progress=False)
    # rows in the spec's order, the second expert family after the composition
    assert [r["row"] for r in res["rows"]] == ["base", "code", "math", "composition", "extra"]
    # "extra" (the math expert again) is tested but never validated nor chosen as the reference
    assert {(r["row"], r["split"]) for r in res["runs"] if r["row"] == "extra"} == {
        ("extra", "test")
    }
    best = res["choices"]["0"]["best_expert"]["arith"]
    assert set(best["validation"]) == {"code", "math"}
    math = [r["items"] for r in res["runs"] if r["split"] == "test" and r["row"] == "math"]
    extra = [r["items"] for r in res["runs"] if r["split"] == "test" and r["row"] == "extra"]
    assert math == extra
    with pytest.raises(mc.SpecError, match=r"candidates\[0\].best_expert: expected true or false"):
        mc.parse_spec({**spec, "candidates": [{"family": "expert", "best_expert": "no"}]})


def test_an_in_memory_merge_is_built_once_per_grid_point(world, tmp_path, monkeypatch):
    import mergelab.merge

    built = []
    merge = mergelab.merge.merge_models
    monkeypatch.setattr(
        mergelab.merge, "merge_models", lambda *a, **k: built.append(k["params"]) or merge(*a, **k)
    )
    second = {
        "name": "arith2",
        "benchmark": world["bench"],
        "split": {"validation": 8, "test": 8},
        "generation": GEN,
        "prompt": {"n_shots": 0},
        "baselines": {},
    }
    spec = _spec_dict(world)
    spec["benchmarks"] = [*spec["benchmarks"], second]
    res = mc.run(spec, cache_dir=tmp_path / "c", progress=False)
    # three λ on two validation benchmarks, then the chosen λ on two test benchmarks: one build
    # per grid point on validation, one for test (unless the chosen λ was the last validated)
    chosen = res["choices"]["0"]["families"]["task_arithmetic"]["params"]["lambda"]
    validated = [{"lambda": v} for v in (0.3, 0.6, 1.0)]
    assert built[:3] == validated
    assert built[3:] == ([] if chosen == 1.0 else [{"lambda": chosen}])


def test_streamed_merges_are_cached_and_reused(world, tmp_path):
    path = _yaml_spec(world, tmp_path / "spec.yaml")
    mc.run(path, cache_dir=tmp_path / "c", progress=False)
    merges = sorted((tmp_path / "c" / "merges").iterdir())
    assert len(merges) == 2 and all((m / "mergelab_merge.json").is_file() for m in merges)
    stamps = [(m / "mergelab_merge.json").stat().st_mtime_ns for m in merges]
    jobs = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c" / "jobs").iterdir()}
    mc.run(path, cache_dir=tmp_path / "c", progress=False)  # everything read back
    assert [(m / "mergelab_merge.json").stat().st_mtime_ns for m in merges] == stamps
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c" / "jobs").iterdir()} == jobs


def test_accelerate_loading_options_reach_from_pretrained(world, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mergelab.compare.candidates import ModelStore

    seen = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        seen.append(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    spec = yaml.safe_load(_yaml_spec(world, tmp_path / "s.yaml").read_text())
    offload = str(tmp_path / "offload")
    spec["loading"] = {
        "device_map": "auto",
        "max_memory": {"cpu": "2GB"},
        "offload_folder": offload,
    }
    store = ModelStore(mc.parse_spec(spec, source="s"), tmp_path / "c")
    plan = mc.make_plan(store.spec)
    comp = next(f for f in store.spec.families if f.family == "composition")
    from mergelab.compare.plan import Point

    store.candidate(Point(comp, comp.name, {"weight": 1.0}), 0)  # base and both experts
    assert len(seen) == 3 and plan is not None
    for kwargs in seen:
        assert kwargs["device_map"] == "auto" and kwargs["offload_folder"] == offload
        assert kwargs["max_memory"] in ({"cpu": "2GB"}, {"cpu": 2_000_000_000})
    assert store.spec.loading["max_memory"] == {"cpu": "2GB"}  # the spec (a cache key) is intact
    spec["loading"] = {"max_memory": {"cpu": "2GB"}}
    with pytest.raises(mc.SpecError, match="loading.max_memory: needs loading.device_map"):
        mc.parse_spec(spec, source="s")


def test_a_merge_without_the_base(world, tmp_path):
    """``use_base: false``: the experts are merged alone (SLERP of two experts, mergekit's
    base-less form), in memory and streamed alike; a method that needs the base refuses it."""
    from mergelab.compare.candidates import ModelStore
    from mergelab.compare.plan import Point
    from mergelab.merge import merge_models

    slerp = {"family": "merge", "method": "slerp", "use_base": False, "grid": {"t": [0.3]}}
    expected = merge_models(
        "slerp", None, [world["experts"]["math"], world["experts"]["code"]], params={"t": 0.3}
    ).state_dict()
    in_memory = mc.parse_spec({**_spec_dict(world), "candidates": [slerp]})
    yaml_spec = yaml.safe_load(_yaml_spec(world, tmp_path / "s.yaml").read_text())
    streamed = mc.parse_spec({**yaml_spec, "candidates": [slerp]}, source="s")
    for spec in (in_memory, streamed):
        store = ModelStore(spec, tmp_path / "c")
        fam = spec.families[0]
        point = Point(fam, "slerp", {"t": 0.3})
        assert store.streams_merge(point) == (spec is streamed)
        if spec is streamed:
            store.ensure_merge(point, 0)
        got = store.merged_model(point, 0).state_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    base_less = ModelStore(streamed, tmp_path / "c").merge_folder(point, 0)
    with_base = mc.parse_spec(
        {**yaml_spec, "candidates": [{**slerp, "use_base": True}]}, source="s"
    )
    with_base_point = Point(with_base.families[0], "slerp", {"t": 0.3})
    assert ModelStore(with_base, tmp_path / "c").merge_folder(with_base_point, 0) != base_less
    ties = {"family": "merge", "method": "ties", "use_base": False}
    with pytest.raises(mc.SpecError, match=r"use_base: merge method 'ties' needs the base"):
        mc.parse_spec({**_spec_dict(world), "candidates": [ties]})
    with pytest.raises(mc.SpecError, match=r"use_base: expected true or false"):
        mc.parse_spec({**_spec_dict(world), "candidates": [{**slerp, "use_base": "no"}]})
