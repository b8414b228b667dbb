"""Inputs mergelab refuses before any work, in one line: tokenizers that give an id two meanings
(merge and compose, one check), files that are not regular files (a FIFO must not hang, /dev/zero
must not fill memory), configs nested too deeply, LoRA adapters of another base, an adapter folder
without --lora, compare's output overlapping its cache; a full disk reported as such (exit 1);
Ctrl-C while the command is still importing (exit 130, no traceback)."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mergelab.cli import main
from mergelab.tiny import DEFAULT_ALPHABET, char_tokenizer, tiny_causal_lm

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """base, math, code share a tokenizer; perm has as many tokens, mapped to other ids;
    longer adds a token after the shared ones; lora/lora_other are adapters of base and of a
    wider model."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer()
    for seed, name in enumerate(["base", "math", "code"]):
        tiny_causal_lm(len(tok), hidden_size=16, num_layers=1, seed=seed).save_pretrained(
            root / name
        )
        tok.save_pretrained(root / name)
    perm = char_tokenizer(DEFAULT_ALPHABET[::-1])
    assert len(perm) == len(tok) and perm.get_vocab() != tok.get_vocab()
    tiny_causal_lm(len(perm), hidden_size=16, num_layers=1, seed=5).save_pretrained(root / "perm")
    perm.save_pretrained(root / "perm")
    longer = char_tokenizer(DEFAULT_ALPHABET + "#")
    tiny_causal_lm(len(tok), hidden_size=16, num_layers=1, seed=6).save_pretrained(root / "longer")
    longer.save_pretrained(root / "longer")  # one id more than the model's rows: extends tok
    base = tiny_causal_lm(len(tok), hidden_size=16, num_layers=1, seed=0)
    for name, model in [
        ("lora", base),
        ("lora_other", tiny_causal_lm(len(tok), hidden_size=32, num_layers=1, seed=0)),
    ]:
        config = LoraConfig(
            r=2, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True
        )
        get_peft_model(copy.deepcopy(model), config).save_pretrained(root / name)
    return root


def run(argv, capsys):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line(err: str, prefix: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("mergelab")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    assert lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError inside the command: exit 1, not 2) instead of hanging on a FIFO."""

    def expire(signum, frame):
        raise TimeoutError(errno.ETIMEDOUT, "the command blocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- tokenizers: one check


def test_merge_refuses_tokenizers_that_map_ids_differently(models, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "merge",
        "--method",
        "linear",
        "--models",
        models / "math",
        models / "perm",
        "--out",
        out,
        "--no-progress",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab merge: error: ")
    assert "maps tokens differently" in line and "tokenizer_source" in line
    assert not out.exists()


def test_mergekit_dialect_refuses_unless_tokenizer_source_aligns(models, tmp_path, capsys):
    config = {
        "merge_method": "linear",
        "models": [
            {"model": str(models / m), "parameters": {"weight": 1.0}} for m in ("math", "perm")
        ],
        "dtype": "float32",
    }
    path = tmp_path / "mk.yaml"
    path.write_text(yaml.safe_dump(config))
    code, err = run(["merge", "--config", path, "--out", tmp_path / "a", "--no-progress"], capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab merge: error: ")
    assert "maps tokens differently" in line and "set tokenizer_source" in line
    path.write_text(yaml.safe_dump({**config, "tokenizer_source": "union"}))
    code, err = run(["merge", "--config", path, "--out", tmp_path / "b", "--no-progress"], capsys)
    assert code == 0, err
    assert (tmp_path / "b" / "tokenizer.json").is_file()


def test_merge_accepts_shared_and_extended_tokenizers(models, tmp_path, capsys):
    """Same files: nothing loaded; one vocabulary extending the other (an added token): every id
    both have is one token, so the check passes (the embedding shapes decide the rest)."""
    from mergelab.vocabulary import check_merge_tokenizers

    check_merge_tokenizers([models / "math", models / "code"], ["math", "code"])
    check_merge_tokenizers([models / "math", models / "longer"], ["math", "longer"])
    with pytest.raises(ValueError, match="maps tokens differently"):
        check_merge_tokenizers([models / "math", models / "perm"], ["math", "perm"])
    code, err = run(
        [
            "merge",
            "--method",
            "linear",
            "--models",
            models / "math",
            models / "code",
            "--out",
            tmp_path / "ok",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err


def test_compose_and_merge_share_the_check(models):
    """Composition needs the same tokenizer exactly; the difference is named by one function."""
    from transformers import AutoTokenizer

    from mergelab.compose.vocab import check_same_tokenizer
    from mergelab.vocabulary import tokenizer_difference

    tok, perm, longer = (
        AutoTokenizer.from_pretrained(models / n) for n in ("math", "perm", "longer")
    )
    diff = tokenizer_difference(tok, perm, "math", "perm")
    assert diff is not None and "50 id(s)" in diff
    with pytest.raises(ValueError, match="maps tokens differently") as info:
        check_same_tokenizer([tok, perm], ["math", "perm"])
    assert diff in str(info.value)
    assert tokenizer_difference(tok, longer, "math", "longer", extension_ok=True) is None
    with pytest.raises(ValueError, match="longer has 55 tokens, math.s has 54"):
        check_same_tokenizer([tok, longer], ["math", "longer"])


# ---------------------------------------------------------------- regular files only


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "folder"])
@pytest.mark.parametrize(
    "where",
    [
        "eval --data",
        "eval --spec",
        "merge --config",
        "compare",
        "compose --prompts-file",
        "compose --composition",
    ],
)
def test_readers_take_regular_files_only(models, tmp_path, capsys, fifo, special, where):
    (tmp_path / "folder").mkdir()
    path = {"fifo": fifo, "/dev/zero": Path("/dev/zero"), "folder": tmp_path / "folder"}[special]
    command, flag = (where.split() + [""])[:2]
    out = tmp_path / "out"
    argv = {
        "eval --data": [
            "eval",
            "run",
            "--model",
            models / "base",
            "--benchmark",
            "gsm8k",
            "--data",
            path,
            "--out",
            out,
            "--cache-dir",
            tmp_path / "cache",
        ],
        "eval --spec": [
            "eval",
            "run",
            "--spec",
            path,
            "--benchmark",
            "gsm8k",
            "--data",
            path,
            "--out",
            out,
            "--cache-dir",
            tmp_path / "cache",
        ],
        "merge --config": ["merge", "--config", path, "--out", out],
        "compare": ["compare", path, "--out", out, "--dry-run"],
        "compose --prompts-file": [
            "compose",
            "--base",
            models / "base",
            "--expert",
            models / "math",
            "--prompts-file",
            path,
        ],
        "compose --composition": [
            "compose",
            "--base",
            models / "base",
            "--expert",
            models / "math",
            "--prompt",
            "ab",
            "--composition",
            path,
        ],
    }[where]
    if where == "eval --spec" and special == "folder":
        pytest.skip("a folder is a valid --spec (a model folder)")
    with deadline(60):
        code, err = run(argv, capsys)
    assert code == 2, err
    line = assert_one_line(err, f"mergelab {command}")
    assert str(path) in line and "is not a file" in line
    assert not out.exists()


def test_a_model_folder_file_that_is_a_fifo_is_refused(models, tmp_path, capsys):
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(models / "code", folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    os.mkfifo(folder / "generation_config.json")
    argv = [
        "merge",
        "--method",
        "linear",
        "--models",
        models / "math",
        folder,
        "--out",
        tmp_path / "out",
        "--no-progress",
    ]
    with deadline(60):
        code, err = run(argv, capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab merge: error: ")
    assert "generation_config.json" in line and "named pipe" in line


def test_benchmark_lines_and_json_lists_are_capped(tmp_path, monkeypatch):
    from mergelab.eval import benchmarks

    monkeypatch.setattr(benchmarks, "MAX_LINE_BYTES", 100)
    monkeypatch.setattr(benchmarks, "MAX_JSON_BYTES", 100)
    data = tmp_path / "x.jsonl"
    data.write_text('{"a": 1}\n{"b": "' + "x" * 200 + '"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: a line longer than 100 bytes"):
        list(benchmarks.read_records(data))
    listed = tmp_path / "x.json"
    listed.write_text("[" + ",".join(['{"a": 1}'] * 30) + "]")
    with pytest.raises(ValueError, match="more than 100 bytes of JSON"):
        list(benchmarks.read_records(listed))


# ---------------------------------------------------------------- nesting


@pytest.mark.parametrize("depth", [150, 5000])
def test_deeply_nested_configs_are_refused_naming_the_file(models, tmp_path, capsys, depth):
    nested = "[" * depth + "]" * depth
    merge_config = tmp_path / "merge.yaml"
    merge_config.write_text(f"method: linear\nmodels: {nested}\n")
    code, err = run(["merge", "--config", merge_config, "--out", tmp_path / "o"], capsys)
    assert code == 2
    assert str(merge_config) in assert_one_line(err, "mergelab merge: error: ")

    spec = tmp_path / "spec.toml"
    spec.write_text(f"name = 'x'\nmodels = {nested}\n")
    code, err = run(["compare", spec, "--out", tmp_path / "c", "--dry-run"], capsys)
    assert code == 2
    assert str(spec) in assert_one_line(err, "mergelab compare: error: ")

    import shutil

    folder = tmp_path / "deep"
    shutil.copytree(models / "code", folder)
    (folder / "config.json").write_text(nested)
    argv = [
        "merge",
        "--method",
        "linear",
        "--models",
        models / "math",
        folder,
        "--out",
        tmp_path / "m",
        "--no-progress",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab merge: error: ")
    assert str(folder / "config.json") in line and "nested" in line


# ---------------------------------------------------------------- LoRA adapters


def test_compose_checks_adapters_against_the_base_before_loading(models, capsys, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the adapter was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    argv = [
        "compose",
        "--base",
        models / "base",
        "--expert",
        models / "lora_other",
        "--lora",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "2",
    ]
    code, err = run(argv, capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab compose: error: ")
    assert "does not fit the base" in line and "[32, 96]" in line and "[16, 48]" in line


def test_the_runner_checks_adapters_against_the_loaded_base(models):
    """Where the checkpoint's names do not tell (a model in memory): checked when stacking."""
    from mergelab.compose.lora import LoraRunner
    from mergelab.lora import as_lora_adapter

    base = tiny_causal_lm(len(char_tokenizer()), hidden_size=16, num_layers=1, seed=0)
    with pytest.raises(ValueError, match="does not fit the base model"):
        LoraRunner(base, [as_lora_adapter(models / "lora_other")], ["other"], 50)
    LoraRunner(base, [as_lora_adapter(models / "lora")], ["fits"], 50)


def test_compose_recognises_an_adapter_folder_without_lora(models, capsys, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("nothing should be loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    code, err = run(
        ["compose", "--base", models / "base", "--expert", models / "lora", "--prompt", "ab"],
        capsys,
    )
    assert code == 2
    line = assert_one_line(err, "mergelab compose: error: ")
    assert "LoRA adapter folder" in line and "pass --lora" in line
    code, err = run(
        [
            "compose",
            "--base",
            models / "base",
            "--expert",
            models / "math",
            "--lora",
            "--prompt",
            "ab",
        ],
        capsys,
    )
    assert code == 2 and "is not a PEFT adapter folder" in assert_one_line(err, "mergelab compose")
    code, err = run(
        ["compose", "--base", models / "lora", "--expert", models / "math", "--prompt", "ab"],
        capsys,
    )
    assert code == 2 and "is a PEFT adapter folder" in assert_one_line(err, "mergelab compose")


# ---------------------------------------------------------------- overlaps before training


def test_compare_example_refuses_out_equal_to_cache_before_training(tmp_path, capsys, monkeypatch):
    from mergelab.compare import example

    def no_training(*args, **kwargs):
        raise AssertionError("the example was trained before the overlap was refused")

    monkeypatch.setitem(example.EXAMPLES, "tiny", no_training)
    out = tmp_path / "same"
    code, err = run(["compare", "--example", "tiny", "--out", out, "--cache", out], capsys)
    assert code == 2
    assert "overlaps" in assert_one_line(err, "mergelab compare: error: ")
    assert not out.exists()


# ---------------------------------------------------------------- a full disk


def _small_tmpfs(path: Path) -> bool:
    """Mount a 16 KiB tmpfs at ``path`` (root in a mount namespace we may use); False if not."""
    if os.geteuid() != 0:
        return False
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


@pytest.fixture(params=["tmpfs", "simulated"])
def full_disk(request, tmp_path, monkeypatch):
    """A folder whose disk is full: a real 16 KiB tmpfs (as root, where mounting works), or
    every write into it failing with ENOSPC."""
    if request.param == "tmpfs":
        folder = tmp_path / "tmpfs"
        if not _small_tmpfs(folder):
            pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
        return
    folder = tmp_path / "disk"
    folder.mkdir()
    # the merge writes its weights with os.write (the engine's plain I/O, and the accelerator's
    # where O_DIRECT is refused), or os.pwritev/os.pwrite (the accelerator's O_DIRECT): fail those
    real_pwritev, real_write = os.pwritev, os.write

    def full(fd, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def checked(real):
        def call(fd, *args):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)):
                full(fd)
            return real(fd, *args)

        return call

    monkeypatch.setattr(os, "pwritev", checked(real_pwritev))
    monkeypatch.setattr(os, "pwrite", checked(os.pwrite))
    monkeypatch.setattr(os, "write", checked(real_write))
    yield folder


def test_a_full_disk_during_a_merge_is_reported_as_such(models, full_disk, capsys):
    out = full_disk / "merged"
    argv = [
        "merge",
        "--method",
        "linear",
        "--models",
        models / "math",
        models / "code",
        "--out",
        out,
        "--no-progress",
    ]
    code, err = run(argv, capsys)
    assert code == 1, err
    line = assert_one_line(err, "mergelab merge: error: ")
    assert "No space left on device" in line and "[ENOSPC]" in line
    assert "BufferError" not in err and "--debug" not in line
    assert not out.exists()
    assert not [p for p in full_disk.iterdir() if p.name != "lost+found"]


def test_the_staging_map_is_closed_after_a_failed_direct_write(tmp_path, monkeypatch):
    """The failing write's frame (held by the traceback) must not keep views of the map."""
    import torch

    from mergelab.merge.accelerator.io import DirectStream

    stream = DirectStream(tmp_path / "x.bin", staging=1 << 16)
    if stream._direct is None:
        stream.abort()
        pytest.skip("O_DIRECT is not available on this file system")

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    monkeypatch.setattr(os, "pwrite", full)
    stream.write(torch.ones(3 << 14, dtype=torch.uint8))
    with pytest.raises(OSError) as info:
        stream.close()
    assert info.value.errno == errno.ENOSPC
    assert stream._buffer is None and stream._file.closed


# ---------------------------------------------------------------- Ctrl-C at start-up


def _interrupt_after_import(module: str, delay: float) -> subprocess.CompletedProcess:
    """Start ``python -m <module> merge ...``, wait until mergelab's first module is imported
    (``-X importtime`` reports it), then after ``delay`` seconds send SIGINT."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("MERGELAB_DEBUG", None)
    argv = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        module,
        "merge",
        "--method",
        "linear",
        "--models",
        "a",
        "b",
        "--out",
        "c",
    ]
    proc = subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        # a test run from a background job inherits SIGINT ignored; a terminal's Ctrl-C is not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "mergelab.errors" in line:
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "".join(lines) + err)


@pytest.mark.parametrize(("module", "delay"), [("mergelab", 0.1), ("mergelab.cli", 0.5)])
def test_ctrl_c_while_importing_exits_130_in_one_line(module, delay):
    done = _interrupt_after_import(module, delay)
    err = "\n".join(line for line in done.stderr.splitlines() if "import time:" not in line)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] in ("mergelab: interrupted", "mergelab merge: interrupted")


# ---------------------------------------------------------------- as root and as a non-root user

AREA_MOUNT = next((d for d in ("/srv", "/media") if os.path.isdir(d)), None)
AS_USER = """
import json, sys
from mergelab.cli import main
area = sys.argv[1] if len(sys.argv) > 1 else {area!r}
codes = [main(["merge", "--config", f"{{area}}/{{name}}", "--out", f"{{area}}/out-{{name}}"])
         for name in ("private.yaml", "pipe.yaml")]
print(json.dumps(codes))
"""


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_unreadable_and_fifo_configs_as_each_user(tmp_path, user):
    """A config the user may not read is an environment fault (exit 1, naming the file and
    EACCES); a FIFO is refused unread (exit 2) whoever runs the command."""
    import json

    import _unpriv

    reason = _unpriv.available(user)
    if reason:
        pytest.skip(f"{user} variant unavailable: {reason}")
    if os.geteuid() == 0 and AREA_MOUNT is None:
        pytest.skip("no /srv or /media directory to bind the test's area onto")
    area = tmp_path / "area"
    area.mkdir(mode=0o755)
    area.chmod(0o755)
    (area / "private.yaml").write_text("method: linear\nmodels: [a]\n")
    (area / "private.yaml").chmod(0o600)
    os.mkfifo(area / "pipe.yaml", 0o666)
    seen, binds = (AREA_MOUNT, {str(area): AREA_MOUNT}) if os.geteuid() == 0 else (str(area), {})
    env = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HOME": seen}
    proc = _unpriv.run_python(
        AS_USER.format(area=seen), user=user, env=env, binds=binds, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    private, pipe = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mergelab merge")]
    assert "Traceback" not in proc.stderr
    assert pipe == 2 and "is not a file: it is a named pipe" in lines[1]
    if user == "unprivileged":
        assert private == 1 and "Permission denied [EACCES]" in lines[0]
        assert f"{seen}/private.yaml" in lines[0]
    else:
        assert private == 2 and "model 'a'" in lines[0]  # readable: its model is missing


def test_compare_refuses_experts_whose_tokenizer_maps_ids_differently(models, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": {
                    "base": str(models / "base"),
                    "experts": {"math": str(models / "math"), "perm": str(models / "perm")},
                },
                "candidates": [{"family": "base"}],
                "benchmarks": [
                    {
                        "name": "math",
                        "task": "synth_math",
                        "file": str(spec),
                        "split": {"validation": 1, "test": 1},
                    }
                ],
            }
        )
    )
    code, err = run(["compare", spec, "--out", tmp_path / "out", "--dry-run"], capsys)
    assert code == 2
    line = assert_one_line(err, "mergelab compare: error: ")
    assert "models.experts.perm maps tokens differently" in line and "one tokenizer" in line


def test_interrupts_are_held_until_the_block_ends():
    """Ctrl-C inside the block (an import of torch, say) is raised once the block is done."""
    from mergelab.errors import interrupts_deferred

    reached = []
    # Python's own handler, as at a terminal (a background test run inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached.append("end of block")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["end of block"]
