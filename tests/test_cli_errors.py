"""`mergelab` exit codes and error lines: 2 and one line for bad input, 1 and one line for an
environment fault (or a bug, pointing to --debug), 130 when interrupted; --debug and
MERGELAB_DEBUG=1 show the traceback."""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

import mergelab.merge.checkpoint as checkpoint
from mergelab.cli import main
from mergelab.tiny import char_tokenizer, tiny_causal_lm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A base and two experts (tiny GPT-2 with a character tokenizer) saved as folders."""
    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer()
    for seed, name in enumerate(["base", "math", "code"]):
        tiny_causal_lm(len(tok), hidden_size=16, num_layers=1, seed=seed).save_pretrained(
            root / name
        )
        tok.save_pretrained(root / name)
    return root


def run(argv, capsys):
    """(exit code, stderr) of ``mergelab *argv``."""
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line(err: str, prefix: str):
    """One error line, the last thing on stderr (libraries may print progress bars before it)."""
    lines = [line for line in err.strip().splitlines() if line.startswith("mergelab")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    assert lines[0].startswith(prefix), err
    assert "Traceback" not in err


def write_config(path, text_or_dict):
    text = text_or_dict if isinstance(text_or_dict, str) else yaml.safe_dump(text_or_dict)
    path.write_text(text)
    return path


def merge_argv(models, out, *extra):
    return [
        "merge",
        "--method",
        "linear",
        "--models",
        models / "math",
        models / "code",
        "--out",
        out,
        "--no-progress",
        *extra,
    ]


# ---------------------------------------------------------------- bad input: exit 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("method: linear\nseed: 1\nmodels: [{m}/math]\nseed: 2\n", "duplicate key 'seed'"),
        ("method: linear\nmodels: [{m}/math]\nseed: x\n", "seed must be an integer, got 'x'"),
        ("method: linear\nmodels: [{m}/math\nseed: 1\n", "merge.yaml:3:5: invalid YAML"),
        ("method: linear\nmodels: [{m}/math]\nshard_size: 0\n", "shard_size must be a positive"),
        (
            "method: slerp\nmodels: [{m}/math, {m}/code]\nparameters: {{t: 1.5}}\n",
            r"t=1.5 is outside [0, 1]",
        ),
        (
            "method: ties\nbase: {m}/base\nmodels: [{m}/math]\nparameters: {{density: 0.5x}}\n",
            "density must be a number, got '0.5x'",
        ),
    ],
)
def test_bad_merge_configs_exit_2_with_one_line(models, tmp_path, capsys, config, message):
    path = write_config(tmp_path / "merge.yaml", config.format(m=models))
    code, err = run(["merge", "--config", path, "--out", tmp_path / "out"], capsys)
    assert code == 2
    assert_one_line(err, "mergelab merge: error: ")
    assert message in err
    assert not (tmp_path / "out").exists()


def test_bad_flags_exit_2(models, tmp_path, capsys):
    code, err = run(merge_argv(models, tmp_path / "out", "--shard-size=-5MB"), capsys)
    assert code == 2 and "shard_size must be a positive size" in err
    code, err = run(merge_argv(models, tmp_path / "out", "--param", "weight=[1, x]"), capsys)
    assert code == 2 and "weight of model 1 must be a number, got 'x'" in err
    assert_one_line(err, "mergelab merge: error: ")


def test_string_parameters_are_numbers_on_the_command_line(models, tmp_path, capsys):
    """--param 'weight="12"' used to give two experts the weights [1.0, 2.0]."""
    out = tmp_path / "out"
    code, _ = run(
        merge_argv(models, out, "--param", 'weight="12"', "--param", "normalize=false"), capsys
    )
    assert code == 0
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["per_model_params"]["weight"] == [12.0, 12.0]
    config = {
        "method": "ties",
        "base": str(models / "base"),
        "models": [
            {"model": str(models / "math"), "parameters": {"density": "0.5"}},
            str(models / "code"),
        ],
        "parameters": {"density": "0.25", "lambda": "0.5"},
        "output": str(tmp_path / "ties"),
    }
    path = write_config(tmp_path / "ties.yaml", config)
    code, _ = run(["merge", "--config", path, "--no-progress"], capsys)
    assert code == 0
    record = json.loads((tmp_path / "ties" / "mergelab_merge.json").read_text())
    assert record["per_model_params"]["density"] == [0.5, 0.25]
    assert record["params"]["lambda_"] == 0.5


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf"])
def test_compose_refuses_a_non_finite_weight(models, tmp_path, capsys, weight):
    argv = [
        "compose",
        "--base",
        models / "base",
        "--expert",
        models / "math",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "2",
        f"--weight={weight}",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    assert_one_line(err, "mergelab compose: error: ")
    assert "weight of term 'expert1' must be a finite number" in err


def test_compose_refuses_a_non_finite_weight_before_loading_anything(models, capsys, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the weights were checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    argv = [
        "compose",
        "--base",
        models / "base",
        "--expert",
        models / "math",
        "--prompt",
        "ab",
        "--weight=nan",
    ]
    code, err = run(argv, capsys)
    assert code == 2 and "must be a finite number" in err


def test_eval_data_errors_exit_2_naming_the_file(models, tmp_path, capsys):
    data = tmp_path / "gsm8k.jsonl"
    data.write_bytes('{"question": "caf\xe9", "answer": "#### 1"}\n'.encode("latin-1"))
    argv = [
        "eval",
        "run",
        "--model",
        models / "base",
        "--benchmark",
        "gsm8k",
        "--data",
        data,
        "--out",
        tmp_path / "res",
        "--cache-dir",
        tmp_path / "cache",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    assert_one_line(err, "mergelab eval run: error: ")
    assert f"{data}:1: not UTF-8 text: byte 0xe9 at byte offset 17" in err
    code, err = run(["eval", "compare", tmp_path / "nope", tmp_path / "nope2"], capsys)
    assert code == 2
    assert_one_line(err, "mergelab eval compare: error: ")


# ---------------------------------------------------------------- environment faults: exit 1


@pytest.mark.parametrize(
    ("errnum", "name"),
    [(errno.ENOSPC, "ENOSPC"), (errno.EROFS, "EROFS"), (errno.EACCES, "EACCES")],
)
def test_an_os_error_while_writing_exits_1_with_one_line(
    models, tmp_path, capsys, monkeypatch, errnum, name
):
    def fail(folder, *args, **kwargs):
        raise OSError(errnum, os.strerror(errnum), str(folder / "model-00001.safetensors"))

    monkeypatch.setattr(checkpoint, "write_sharded", fail)
    out = tmp_path / "out"
    code, err = run(merge_argv(models, out), capsys)
    assert code == 1
    assert_one_line(err, "mergelab merge: error: ")
    assert os.strerror(errnum) in err and f"[{name}]" in err and "--debug" not in err
    assert str(out) in err  # the path: the output, or the file that failed inside it
    assert not out.exists()

    # --debug, before or after the subcommand, or MERGELAB_DEBUG=1: the traceback, same exit code
    for argv in (["--debug", *merge_argv(models, out)], [*merge_argv(models, out), "--debug"]):
        code, err = run(argv, capsys)
        assert code == 1 and "Traceback" in err and "in fail" in err
        assert err.strip().splitlines()[-1].startswith("mergelab merge: error: ")
    monkeypatch.setenv("MERGELAB_DEBUG", "1")
    code, err = run(merge_argv(models, out), capsys)
    assert code == 1 and "Traceback" in err


def test_interrupt_exits_130_and_a_bug_exits_1_pointing_to_debug(
    models, tmp_path, capsys, monkeypatch
):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_sharded", interrupt)
    code, err = run(merge_argv(models, tmp_path / "out"), capsys)
    assert code == 130
    assert_one_line(err, "mergelab merge: interrupted")

    def bug(*args, **kwargs):
        raise RuntimeError("unexpected state")

    monkeypatch.setattr(checkpoint, "write_sharded", bug)
    code, err = run(merge_argv(models, tmp_path / "out"), capsys)
    assert code == 1
    assert_one_line(err, "mergelab merge: error: RuntimeError: unexpected state")
    assert err.strip().endswith("(rerun with --debug for the traceback)")


def test_the_installed_command_prints_one_line(models, tmp_path):
    """The real entry point, in a fresh process: no traceback reaches the terminal."""
    path = write_config(
        tmp_path / "merge.yaml", f"method: linear\nmodels: [{models}/math]\nseed: x\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MERGELAB_DEBUG", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mergelab.cli",
            "merge",
            "--config",
            str(path),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "mergelab merge: error: merge config: seed must be an integer, got 'x'"
    )


def test_the_command_exits_without_teardown_yet_runs_exit_handlers_and_flushes(tmp_path):
    """The command ends its process with ``os._exit`` once it returns (no interpreter teardown),
    but the exit code is the command's, the exit handlers ran, and what was printed to a pipe
    (block-buffered) reached it, in order."""
    script = (
        "import atexit, sys\n"
        "from mergelab import cli\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "print('before the command')\n"
        "sys.exit(cli.main())\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MERGELAB_DEBUG", None)
    env.pop("PYTHONUNBUFFERED", None)  # stdout to a pipe is then block-buffered
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "merge",
            "--config",
            str(missing),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == ["before the command", "exit handler ran"]
    assert proc.stderr.startswith("mergelab merge: error:") and "missing.yaml" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_error_lines_for_each_kind_of_exception():
    from mergelab.errors import exit_code, one_line

    assert exit_code(FileNotFoundError("x")) == 2 and exit_code(IsADirectoryError("x")) == 2
    assert exit_code(PermissionError(errno.EACCES, "Permission denied", "/out")) == 1
    assert one_line(PermissionError(errno.EACCES, "Permission denied", "/out")) == (
        "Permission denied [EACCES]: /out"
    )
    assert (
        exit_code(yaml.YAMLError("bad")) == 2 and exit_code(json.JSONDecodeError("m", "d", 0)) == 2
    )
    assert (
        exit_code(MemoryError()) == 1
        and exit_code(torch.OutOfMemoryError("CUDA out of memory")) == 1
    )
    assert (
        one_line(KeyError("unknown benchmark 'x'; known: [...]"))
        == "unknown benchmark 'x'; known: [...]"
    )
    assert one_line(KeyError("seed")) == "KeyError: 'seed'"  # a bare lookup may be a bug
    assert one_line(ValueError("two\nlines")) == "two lines"
    assert exit_code(RuntimeError("?")) == 1 and exit_code(KeyboardInterrupt()) == 130


def test_one_subcommand_is_loaded_and_the_help_lists_them_all(monkeypatch, capsys):
    """`mergelab merge ...` imports only the merge command's module; the top-level help (or an
    unknown command) lists every subcommand with its help without importing any of them, and
    that help is each module's own."""
    from mergelab import cli

    imported = []
    real = cli.import_without_collecting
    monkeypatch.setattr(cli, "import_without_collecting", lambda n: imported.append(n) or real(n))
    assert cli._subcommand(["--debug", "merge", "--config", "x.yml"]) == "merge"
    assert cli._subcommand(["--help"]) is None and cli._subcommand(["mrege"]) is None
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert imported == ["mergelab.merge.cli"]
    imported.clear()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert imported == []
    shown = capsys.readouterr().out
    assert all(name in shown for name in cli.SUBCOMMAND_MODULES)
    full = cli.build_parser()  # every module imported: their own help lines
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    own = {c.dest: c.help for c in sub._choices_actions}
    assert own == cli.SUBCOMMAND_HELP


def _after_import(before: str, shown: str) -> list[str]:
    """What ``print(shown)`` prints in a fresh interpreter that ran ``before`` (with ``gc``
    imported), then ``from mergelab import ModelCandidate`` (``import mergelab`` alone imports
    no torch)."""
    code = f"import gc\n{before}\nfrom mergelab import ModelCandidate\nprint({shown})\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_import_leaves_torch_objects_out_of_the_young_collections():
    """After importing mergelab's candidates, torch's objects sit in the collector's oldest generation, not
    in the youngest (where the next two collections would each walk them all), and nothing new
    is frozen; a process that had frozen objects of its own keeps them frozen."""
    shown = "len(gc.get_objects(generation=0)), len(gc.get_objects(generation=2)), "
    young, old, frozen, enabled = _after_import("", shown + "gc.get_freeze_count(), gc.isenabled()")
    assert int(young) < 1000 < 100_000 < int(old)
    assert (frozen, enabled) == ("0", "True")
    kept = _after_import(
        "gc.freeze()", "gc.get_freeze_count() > 1000, len(gc.get_objects(generation=2)) < 100_000"
    )
    assert kept == ["True", "True"]


def test_the_command_leaves_torch_out_of_the_last_collection():
    """Run as a program, `mergelab` freezes the collector's objects before exiting (the exit's
    full collection would walk all of torch's); called from Python, it leaves them alone."""
    import gc

    before = gc.get_freeze_count()
    code = (
        "import gc, sys\n"
        "from mergelab.cli import main\n"
        "sys.argv = ['mergelab', 'merge', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(gc.get_freeze_count() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip().endswith("True"), done.stderr
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert gc.get_freeze_count() == before
