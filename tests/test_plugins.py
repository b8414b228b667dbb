"""Plugins (mergelab/plugins.py, docs/guides/plugins.md): a merge method and a task written out of tree,
used from `mergelab merge`, merge configs in both dialects, `mergelab eval`, a compare spec
(local and, slow, Ray), and an installed package's entry point; the one-line errors.

The plugin files are docs/guides/plugins.md's own examples, copied out of the page: the page's code is
what runs here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

import mergelab.plugins as plugins
from mergelab.cli import main
from mergelab.eval.tasks import get_task, task_origins, unregister_task
from mergelab.merge import merge_state_dicts, unregister_merge_method
from mergelab.merge.checkpoint import CheckpointFolder
from mergelab.merge.registry import merge_method_origins

DOCS = Path(__file__).resolve().parents[1] / "docs" / "guides" / "plugins.md"
WORDS = ["France", "Japan", "Peru", "Kenya", "Chile", "Spain"]
CAPITALS = ["Paris", "Tokyo", "Lima", "Nairobi", "Santiago", "Madrid"]


def doc_files() -> dict[str, str]:
    """The page's ```python blocks whose first line is ``# <name>.py``: file name → source."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
    return {b.split("\n", 1)[0][2:].strip(): b for b in blocks if re.match(r"# \w+\.py\n", b)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The plugin files (docs/guides/plugins.md), tiny checkpoints with a character tokenizer, a data
    file; names the plugins register are unregistered afterwards."""
    from mergelab.tiny import char_tokenizer, tiny_llama

    root = tmp_path_factory.mktemp("plugins")
    files = doc_files()
    assert set(files) == {"my_methods.py", "my_tasks.py"}
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    tok = char_tokenizer(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n",
        bos=None,
        unk="<unk>",
        padding_side="left",
    )
    sds = {}
    for i, name in enumerate(["base", "math", "code"]):
        model = tiny_llama(tok, hidden_size=16, num_layers=1, seed=0, initializer_range=0.3)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        sds[name] = {k: v.clone() for k, v in model.state_dict().items()}
    with open(root / "capitals.jsonl", "w") as f:
        for i, (country, capital) in enumerate(zip(WORDS, CAPITALS)):
            f.write(json.dumps({"id": i, "country": country, "capital": capital}) + "\n")
    yield {"root": root, "sds": sds}
    for name in ("scaled_average", "module_method", "ep_method", "median_task_vector"):
        unregister_merge_method(name)
    unregister_task("capitals")


def read(folder) -> dict[str, torch.Tensor]:
    with CheckpointFolder(folder) as f:
        return {n: f.read(n).clone() for n in f.tensors}


def expected_merge(sds, scale: float, weights=(1.0, 1.0)) -> dict[str, torch.Tensor]:
    """What docs/guides/plugins.md's scaled_average computes, by hand (float32 throughout)."""
    out = {}
    for name, base in sds["base"].items():
        experts = [sds["math"][name], sds["code"][name]]
        delta = sum(w * (e - base) for w, e in zip(weights, experts)) / sum(weights)
        out[name] = base + scale * delta
    return out


def assert_close(got, expected):
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def merge_args(root, *extra):
    return [
        "merge",
        "--base",
        str(root / "base"),
        "--model",
        str(root / "math"),
        "--model",
        str(root / "code"),
        "--no-progress",
        *extra,
    ]


def one_error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ----------------------------------------------------------------------------------------------
# Merge methods


def test_method_from_a_file_on_the_command_line(world, tmp_path):
    root, sds = world["root"], world["sds"]
    out = tmp_path / "merged"
    args = ["--plugin", str(root / "my_methods.py"), "--method", "scaled_average"]
    assert main(merge_args(root, *args, "--param", "scale=0.8", "--out", str(out))) == 0
    got = read(out)
    assert_close(got, expected_merge(sds, 0.8))
    library = merge_state_dicts(
        "scaled_average", sds["base"], [sds["math"], sds["code"]], params={"scale": 0.8}
    )
    assert all(torch.equal(got[k], library[k]) for k in library)  # the CLI = the library
    origin = merge_method_origins()["scaled_average"]
    assert origin == f"file {(root / 'my_methods.py').resolve()}"
    assert merge_method_origins()["ties"] == "builtin"


def test_the_readme_method_example_runs_from_the_cli_out_of_tree(world, tmp_path):
    """README.s "Add a method" block, as a user's file (its last line, which merges
    in memory, left out), run by `mergelab merge --plugin`."""
    root, sds = world["root"], world["sds"]
    readme = (DOCS.parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Add a method") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "median.py").write_text(block[: block.index("\nmerged = ")], encoding="utf-8")
    out = tmp_path / "out"
    args = ["--plugin", str(tmp_path / "median.py"), "--method", "median_task_vector"]
    assert main(merge_args(root, *args, "--param", "lambda=0.5", "--out", str(out))) == 0
    expected = {}
    for name, base in sds["base"].items():
        taus = torch.stack([sds[e][name] - base for e in ("math", "code")])
        expected[name] = base + 0.5 * taus.median(dim=0).values
    assert_close(read(out), expected)


def test_method_from_merge_configs_in_both_dialects(world, tmp_path, monkeypatch):
    root, sds = world["root"], world["sds"]
    monkeypatch.chdir(tmp_path)  # the plugin path is read relative to the config, not here
    ours = {
        "plugins": ["my_methods.py"],
        "method": "scaled_average",
        "base": "base",
        "models": [{"model": "math", "parameters": {"weight": 1.0}}, "code"],
        "parameters": {"scale": 0.5},
    }
    (root / "ours.yaml").write_text(yaml.safe_dump(ours))
    out = tmp_path / "ours"
    assert (
        main(["merge", "--config", str(root / "ours.yaml"), "--out", str(out), "--no-progress"])
        == 0
    )
    assert_close(read(out), expected_merge(sds, 0.5))

    theirs = {
        "plugins": "my_methods.py",
        "merge_method": "scaled_average",
        "base_model": "base",
        "models": [
            {"model": "math", "parameters": {"weight": 3.0}},
            {"model": "code", "parameters": {"weight": 1.0}},
        ],
        "parameters": {"scale": 0.5},
        "dtype": "float32",
    }
    (root / "theirs.yaml").write_text(yaml.safe_dump(theirs))
    out = tmp_path / "theirs"
    assert (
        main(["merge", "--config", str(root / "theirs.yaml"), "--out", str(out), "--no-progress"])
        == 0
    )
    assert_close(read(out), expected_merge(sds, 0.5, weights=(3.0, 1.0)))


def test_method_from_a_module_found_from_the_working_directory(world, tmp_path, monkeypatch):
    root, sds = world["root"], world["sds"]
    pkg = tmp_path / "user_pkg_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "methods.py").write_text(
        "from mergelab.merge import merge_method\n\n\n"
        "@merge_method('module_method')\n"
        "def module_method(base, experts, *, weight, ctx):\n"
        "    return experts[0].clone()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the fallback appends the folder
    out = tmp_path / "out"
    args = ["--plugin", "user_pkg_plugins.methods", "--method", "module_method", "--out", str(out)]
    assert main(merge_args(root, *args)) == 0
    assert_close(read(out), sds["math"])
    assert merge_method_origins()["module_method"] == "module user_pkg_plugins.methods"


def test_unknown_names_list_what_is_registered_and_where_from(world, tmp_path, capsys):
    root = world["root"]
    args = [
        "--plugin",
        str(root / "my_methods.py"),
        "--method",
        "scaled_avg",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(merge_args(root, *args)) == 2
    line = one_error_line(capsys)
    assert "unknown merge method 'scaled_avg'; registered: builtin: " in line
    assert f"file {(root / 'my_methods.py').resolve()}: scaled_average" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "source, words",
    [
        (None, "does not exist"),
        ("import torh\n", "failed to import: ModuleNotFoundError: No module named 'torh'"),
        ("raise RuntimeError('half written')\n", "failed to import: RuntimeError: half written"),
        (
            "from mergelab.merge import merge_method\n\n"
            "@merge_method('ties')\ndef ties(base, experts, *, weight, ctx):\n    return base\n",
            "merge method 'ties' (file {path}) is already registered (builtin)",
        ),
    ],
)
def test_a_bad_plugin_is_one_line_and_exit_2(world, tmp_path, capsys, source, words):
    path = tmp_path / "bad_plugin.py"
    if source is not None:
        path.write_text(source)
    args = ["--plugin", str(path), "--method", "linear", "--out", str(tmp_path / "o")]
    assert main(merge_args(world["root"], *args)) == 2
    line = one_error_line(capsys)
    assert words.format(path=path.resolve()) in line, line
    assert str(path.resolve()) in line
    assert "bad_plugin" not in " ".join(sys.modules)  # nothing half-imported is left behind


def test_a_missing_module_is_one_line(world, tmp_path, capsys):
    args = [
        "--plugin",
        "no_such_pkg_xyz.methods",
        "--method",
        "linear",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(merge_args(world["root"], *args)) == 2
    assert "plugin module 'no_such_pkg_xyz.methods' not found" in one_error_line(capsys)


def test_loading_the_same_plugin_twice_does_nothing(world):
    path = world["root"] / "my_methods.py"
    first = plugins.load_plugin(path)
    assert plugins.load_plugin(str(path)) == first == str(path.resolve())
    assert plugins.loaded().count(f"file {path.resolve()}") == 1


# ----------------------------------------------------------------------------------------------
# Tasks


def test_task_from_a_plugin_in_eval(world, tmp_path):
    root = world["root"]
    out = tmp_path / "eval"
    code = main(
        [
            "eval",
            "run",
            "--plugin",
            str(root / "my_tasks.py"),
            "--model",
            str(root / "base"),
            "--benchmark",
            "capitals",
            "--data",
            str(root / "capitals.jsonl"),
            "--max-new-tokens",
            "4",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"]["task"] == "capitals" and summary["n_items"] == len(WORDS)
    items = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines()]
    assert [it["prompt"] for it in items] == [f"The capital of {w} is" for w in WORDS]
    assert [it["reference"] for it in items] == CAPITALS
    # the task's own scorer decided: a sample is correct exactly when its first line is the answer
    for it in items:
        sample = it["samples"][0]
        assert sample["correct"] == (sample["text"].strip().split("\n")[0] == it["reference"])
    assert task_origins()["capitals"] == f"file {(root / 'my_tasks.py').resolve()}"
    assert task_origins()["gsm8k"] == "builtin"


def compare_spec(root: Path, path: Path, **over) -> Path:
    spec = {
        "name": "plugins",
        "plugins": ["my_methods.py", "my_tasks.py"],
        "models": {"base": "base", "experts": {"math": "math", "code": "code"}},
        "candidates": [
            {"family": "base"},
            {"family": "merge", "method": "scaled_average", "params": {"scale": 0.8}},
        ],
        "benchmarks": [
            {
                "name": "capitals",
                "benchmark": "capitals",
                "path": "capitals.jsonl",
                "generation": {"max_new_tokens": 4, "batch_size": 6},
            }
        ],
        "statistics": {"bootstrap_samples": 100},
        **over,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_method_and_task_from_a_compare_spec(world, tmp_path, monkeypatch):
    import mergelab.compare as mc

    root = world["root"]
    spec = compare_spec(root, root / "compare.yaml")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert (
        main(
            [
                "compare",
                str(spec),
                "--out",
                str(out),
                "--cache",
                str(tmp_path / "cache"),
                "--no-progress",
            ]
        )
        == 0
    )
    results = mc.load_results(out / "results.json")
    assert results["benchmarks"]["capitals"]["task"] == "capitals"
    rows = {r["row"] for r in results["runs"]}
    assert len(rows) == 2 and any("scaled_average" in r for r in rows)
    assert all(len(r["items"]) == len(WORDS) for r in results["runs"])
    assert results["spec"]["plugins"] == ["my_methods.py", "my_tasks.py"]
    assert results["plugins"] == [
        str((root / f).resolve()) for f in ("my_methods.py", "my_tasks.py")
    ]
    # the merge the comparison evaluated is the plugin's
    merged = [p for p in (tmp_path / "cache" / "merges").iterdir() if p.is_dir()]
    assert len(merged) == 1
    assert_close(read(merged[0]), expected_merge(world["sds"], 0.8))


def test_dry_run_names_the_plugins_and_their_method_and_task(world, capsys):
    spec = compare_spec(world["root"], world["root"] / "compare_dry.yaml")
    assert main(["compare", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"plugins: {(world['root'] / 'my_methods.py').resolve()}, " in out
    assert "scaled_average" in out and "capitals" in out


def test_a_spec_with_a_missing_plugin_is_refused_at_dry_run(world, tmp_path, capsys):
    spec = compare_spec(world["root"], tmp_path / "spec.yaml", plugins=["nope.py"])
    assert main(["compare", str(spec), "--dry-run"]) == 2
    line = one_error_line(capsys)
    assert f"{spec}: plugins: plugin file {(tmp_path / 'nope.py').resolve()} does not" in line


@pytest.mark.slow
def test_spec_plugins_reach_ray_workers(world, tmp_path):
    """Ray workers are fresh processes: they know the plugin's method and task only because each
    job loads the spec's plugins (no worker_process_setup_hook)."""
    ray = pytest.importorskip("ray")
    import mergelab.compare as mc

    spec = compare_spec(world["root"], world["root"] / "compare_ray.yaml")
    local = mc.run(spec, cache_dir=tmp_path / "local", progress=False)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(mc.__file__).parents[2])}},
    )
    try:
        remote = mc.run(
            spec,
            cache_dir=tmp_path / "ray",
            executor={"kind": "ray", "num_cpus": 1},
            progress=False,
        )
    finally:
        ray.shutdown()
    strip = lambda rs: [{k: v for k, v in r.items() if k != "cost"} for r in rs]  # noqa: E731
    assert strip(remote["runs"]) == strip(local["runs"])
    assert len(list((tmp_path / "ray" / "jobs").glob("*.json"))) == len(local["runs"])


# ----------------------------------------------------------------------------------------------
# Entry points


def _distribution(folder: Path, module_source: str, name: str = "ep_demo") -> None:
    """A package ``mergelab_<name>`` installed (a dist-info on sys.path) as distribution
    ``mergelab-<name>`` 0.1, with entry point ``<name>`` in the group mergelab.plugins."""
    pkg = folder / f"mergelab_{name}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(module_source)
    info = folder / f"mergelab_{name}-0.1.dist-info"
    info.mkdir()
    dist = f"mergelab-{name.replace('_', '-')}"
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mergelab.plugins]\n{name} = mergelab_{name}\n")


def test_an_installed_package_is_found_through_its_entry_point(world, tmp_path, monkeypatch):
    root = world["root"]
    _distribution(
        tmp_path,
        "from mergelab.merge import merge_method\n\n\n"
        "@merge_method('ep_method')\n"
        "def ep_method(base, experts, *, weight, ctx):\n"
        "    return experts[-1].clone()\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    out = tmp_path / "out"
    assert main(merge_args(root, "--method", "ep_method", "--out", str(out))) == 0
    assert_close(read(out), world["sds"]["code"])
    assert merge_method_origins()["ep_method"] == "entry point ep_demo (mergelab-ep-demo 0.1)"


def test_a_broken_entry_point_is_one_line(world, tmp_path, monkeypatch, capsys):
    _distribution(tmp_path, "raise ImportError('needs a newer mergelab')\n", "ep_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    args = ["--method", "linear", "--out", str(tmp_path / "o")]
    assert main(merge_args(world["root"], *args)) == 2
    line = one_error_line(capsys)
    assert "plugin entry point ep_broken (mergelab-ep-broken 0.1) = mergelab_ep_broken" in line
    assert "failed to import: ImportError: needs a newer mergelab" in line


def test_get_task_lists_plugin_tasks_with_their_origin(world):
    plugins.load_plugin(world["root"] / "my_tasks.py")
    assert get_task("capitals").kind == "answer"
    with pytest.raises(KeyError, match=r"file .*my_tasks.py: capitals"):
        get_task("capital")
