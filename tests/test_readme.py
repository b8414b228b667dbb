"""The README as a user meets it: short, the findings near the top, the test command the one CI
runs, and every code block valid — and run, in order, as a user would (slow: it trains the
example's models)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mergelab.merge import list_merge_methods, unregister_merge_method

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(text: str | None = None) -> list[tuple[str, str]]:
    """Every fenced ```bash / ```python block of the README, in order, as (language, code)."""
    text = README.read_text() if text is None else text
    return re.findall(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M)


def section(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_readme_is_short_with_the_findings_near_the_top():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    start = lines.index("<!-- findings:start -->")
    end = lines.index("<!-- findings:end -->")
    assert start < end < 150
    table = lines[start + 1 : end]
    assert table[0] == "| claim | evidence (file, number, CI, seeds) | status |"
    assert len(table) >= 5 and all(row.startswith("|") for row in table)


def test_the_two_commands_are_the_main_job_and_cis_test_command():
    two = blocks(section("Two commands"))
    assert [lang for lang, _ in two] == ["bash", "bash"]
    main_job, tests = (code.strip() for _, code in two)
    assert "mergelab compare --example letters" in main_job
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci  # the README's test command, word for word, is a line of CI


def test_every_block_is_valid_code():
    from mergelab.cli import SUBCOMMAND_MODULES

    found = blocks()
    assert len(found) >= 6
    for lang, code in found:
        if lang == "python":
            compile(code, "README.md", "exec")
        else:
            done = subprocess.run(["bash", "-n"], input=code, text=True, capture_output=True)
            assert done.returncode == 0, done.stderr
            for sub in re.findall(r"\bmergelab (\w+)", code):
                assert sub in SUBCOMMAND_MODULES, sub


def test_the_add_a_method_example_runs_as_written():
    (code,) = [c for lang, c in blocks(section("Add a method")) if lang == "python"]
    namespace: dict = {}
    torch.manual_seed(0)
    try:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
        assert "median_task_vector" in list_merge_methods()
        base, experts, merged = namespace["base"], namespace["experts"], namespace["merged"]
        for name, b in base.state_dict().items():
            taus = torch.stack([e.state_dict()[name] - b for e in experts])
            expected = b + 0.5 * taus.median(dim=0).values
            torch.testing.assert_close(merged.state_dict()[name], expected, rtol=0, atol=0)
    finally:
        unregister_merge_method("median_task_vector")


# `mergelab` as this checkout's code (the console script would import the installed copy). With
# MERGELAB_README_QUICK=1 the example trains on tiny budgets: the same commands, weaker models.
SHIM = """
import os, sys
if os.environ.get("MERGELAB_README_QUICK"):
    import mergelab.compare.example as ex
    ex.LETTERS_TRAIN.update(base_steps=20, expert_steps=5)
from mergelab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(3600)  # trains the example's models, then the tour: minutes on 2 cores
def test_every_block_runs_in_order(tmp_path):
    """The main job, then the tour on its models, in one folder, as a user would paste them.
    `pip install` is skipped (this is the installed environment) and so is the test command
    (CI runs it itself; the test above keeps it identical to CI's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    (tmp_path / "shim.py").write_text(SHIM)
    prelude = (
        "set -euo pipefail\n"
        "pip() { :; }\n"
        f'mergelab() {{ "{sys.executable}" "{tmp_path / "shim.py"}" "$@"; }}\n'
    )
    ran = 0
    for i, (lang, code) in enumerate(blocks()):
        if "pytest" in code:
            continue
        if lang == "bash":
            cmd = ["bash", "-c", prelude + code]
        else:
            script = tmp_path / f"block{i}.py"
            script.write_text(code)
            cmd = [sys.executable, str(script)]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (
            f"block {i}:\n{code}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
        )
        ran += 1
    assert ran == len(blocks()) - 1
    assert (tmp_path / "runs" / "compare-letters" / "results.json").is_file()
    assert (tmp_path / "runs" / "ties" / "mergelab_merge.json").is_file()
    assert (tmp_path / "runs" / "mine" / "results.json").is_file()
