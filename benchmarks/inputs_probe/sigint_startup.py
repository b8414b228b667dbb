"""Ctrl-C during the first moments of the ``mergelab`` console script: which part of start-up
each interrupt lands in. One JSON line per try; ``results/inputs/sigint_startup.jsonl`` holds
its output (docs/inputs.md, "Reported as what they are").

    python benchmarks/inputs_probe/sigint_startup.py REPO [DELAYS] [REPEATS] > out.jsonl

The script run is a copy of the entry-point script pip writes for ``mergelab`` (``from
mergelab.cli import main``), with mergelab imported from REPO (PYTHONPATH). Each try sends
SIGINT DELAY seconds after the process starts; ``phase`` classifies what it printed:

* ``before_handler`` — killed by the signal, silently: Python had not yet installed its handler;
* ``interpreter_startup`` — "Fatal Python error: init_…": the interpreter was still starting
  (its ``site`` module, the ``.pth`` files of the installed packages), before the script's first
  line, so before any of mergelab's code;
* ``mergelab`` — one line, "mergelab: interrupted", exit code 130;
* ``other`` — anything else (a traceback from the script or from mergelab's modules).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ENTRY_POINT = """import re
import sys
from mergelab.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def phase(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    if rc == -signal.SIGINT and not lines:
        return "before_handler"
    if lines and lines[0].startswith("Fatal Python error: init_"):
        return "interpreter_startup"
    if rc == 130 and lines == ["mergelab: interrupted"]:
        return "mergelab"
    return "other"


def main() -> None:
    repo = sys.argv[1]
    delays = [
        float(x)
        for x in (sys.argv[2] if len(sys.argv) > 2 else "0,0.05,0.1,0.15,0.2,0.3,0.5").split(",")
    ]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    env = {**os.environ, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1"}
    folder = tempfile.mkdtemp()
    script = os.path.join(folder, "mergelab")  # named as the console script is
    with open(script, "w") as f:
        f.write(ENTRY_POINT)
    for delay in delays:
        for _ in range(repeats):
            p = subprocess.Popen(
                [sys.executable, script, "merge", "--help"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            err = p.communicate(timeout=120)[1]
            lines = [line for line in err.splitlines() if line.strip()]
            frames = [ln.split('"')[1] for ln in lines if ln.strip().startswith('File "')]
            record = {
                "delay_s": delay,
                "rc": p.returncode,
                "phase": phase(p.returncode, err),
                "first_line": lines[0][:200] if lines else "",
                "lines": len(lines),
                # frames in mergelab's package or the entry-point script (not setuptools' editable finder)
                "mergelab_frames": [f for f in frames if "/mergelab/" in f or f == script],
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
