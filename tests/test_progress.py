"""Progress in a log file: plain lines (done/total, rate, ETA), at most one per interval."""

import io

from mergelab.progress import LineProgress, progress_bar


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_carry_count_rate_and_eta_and_are_rate_limited():
    clock, out = Clock(), io.StringIO()
    bar = LineProgress(
        total=10, desc="test (seed 0)", unit="job", stream=out, interval=5.0, clock=clock
    )
    for _ in range(10):
        clock.now += 2.0  # a job every 2 s: a line at most every 5 s
        bar.set_postfix_str("ties[density=0.2] · gsm8k")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "test (seed 0): 0/10 jobs (0%), elapsed 0s"
    # lines at t = 6, 12, 18 s (each ≥ 5 s after the last), then the final one at 20 s
    assert lines[1] == (
        "test (seed 0): 3/10 jobs (30%), 2.0 s/job, ETA 14s, elapsed 6s · ties[density=0.2] · gsm8k"
    )
    assert len(lines) == 5
    assert lines[-1] == "test (seed 0): 10/10 jobs (100%), 2.0 s/job, elapsed 20s"


def test_fast_work_reports_a_rate_per_second_and_an_iterable_closes_itself():
    clock, out = Clock(), io.StringIO()

    def items():
        for i in range(40):
            clock.now += 0.25
            yield i

    assert sum(LineProgress(items(), total=40, desc="x", stream=out, clock=clock)) == 780
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("x: 20/40 its (50%), 4.00 its/s, ETA 5s")
    assert lines[-1].startswith("x: 40/40 its (100%), 4.00 its/s")


def test_not_a_terminal_gives_lines_and_disabled_gives_nothing():
    out = io.StringIO()
    bar = progress_bar(range(3), desc="merges", unit="merge", stream=out)
    assert isinstance(bar, LineProgress)
    list(bar)
    assert out.getvalue().splitlines()[-1].startswith("merges: 3/3 merges (100%)")
    quiet = io.StringIO()
    list(progress_bar(range(3), desc="merges", enabled=False, stream=quiet))
    assert quiet.getvalue() == ""
