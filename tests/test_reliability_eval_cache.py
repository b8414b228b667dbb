"""The evaluation cache: incomplete records are dropped with a warning and regenerated; runs that
share one cache (threads or processes) split the work and leave a valid file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from mergelab.candidate import Generation, GenerationSettings
from mergelab.eval import Benchmark, EvalSettings, Item, evaluate
from mergelab.eval.harness import CacheRecordWarning

SETTINGS = EvalSettings(
    generation=GenerationSettings(max_new_tokens=8, batch_size=2), bootstrap_samples=200
)


def toy_benchmark(n: int) -> Benchmark:
    items = [Item(f"toy/{i}", f"What is {i} plus {i}?", answer=str(2 * i)) for i in range(n)]
    return Benchmark.from_items("toy-sums", "gsm8k", items)


class SlowCandidate:
    """Answers every prompt right after ``delay`` seconds per batch; counts what it generated."""

    def __init__(self, bench: Benchmark, delay: float = 0.0, name: str = "slow"):
        self.name = name
        self.tokenizer = None
        self.delay = delay
        self.answers = {it.prompt: it.answer for it in bench.items}
        self.seen: list[str] = []

    def generate(self, prompts, settings=None):
        time.sleep(self.delay)
        self.seen.extend(prompts)
        out = []
        for p in prompts:
            answer = next(a for q, a in self.answers.items() if q in p[-200:])
            out.append(Generation(p, f"The answer is {answer}.", [0], "eos"))
        return out

    def describe(self):
        return {"kind": "SlowCandidate", "name": self.name}


def cache_lines(result) -> list[dict]:
    text = (result.run_dir / "generations.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_incomplete_records_are_dropped_with_a_warning_and_regenerated(tmp_path):
    bench = toy_benchmark(6)
    first = evaluate(SlowCandidate(bench), bench, SETTINGS, cache_dir=tmp_path, progress=False)
    cache = first.run_dir / "generations.jsonl"
    lines = cache.read_text().splitlines()
    no_text = {k: v for k, v in json.loads(lines[1]).items() if k != "text"}
    bool_sample = {**json.loads(lines[2]), "sample": True}
    lines[1] = json.dumps(no_text)
    lines[2] = json.dumps(bool_sample)
    lines[3] = "null"
    lines[4] = "[1, 2]"
    lines.insert(0, '{"foo": 1}')
    cache.write_text("\n".join(lines) + "\n")

    again = SlowCandidate(bench)
    with pytest.warns(CacheRecordWarning) as caught:
        result = evaluate(again, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 5
    assert all(m.startswith(f"{cache}:") and "regenerated" in m for m in messages)
    assert f"{cache}:1:" in messages[0] and "no string 'item_id'" in messages[0]
    assert f"{cache}:3:" in messages[1] and "no string 'text'" in messages[1]
    assert "NoneType" in messages[3] and "list" in messages[4]
    assert len(again.seen) == 4  # exactly the four items whose records were bad
    assert result.score() == first.score() == 1.0
    records = cache_lines(result)
    assert sorted(r["item_id"] for r in records) == sorted(it.item_id for it in bench.items)

    with warnings.catch_warnings():  # the bad lines were removed from the file: no warning
        warnings.simplefilter("error", CacheRecordWarning)
        third = SlowCandidate(bench)
        evaluate(third, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    assert third.seen == []


def test_two_runs_on_one_cache_share_the_work(tmp_path):
    bench = toy_benchmark(12)
    candidates = [SlowCandidate(bench, delay=0.2) for _ in range(2)]
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = evaluate(
                candidates[i], bench, SETTINGS, cache_dir=tmp_path, progress=False
            )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    seen = [len(c.seen) for c in candidates]
    assert sum(seen) == 12 and min(seen) >= 2  # both worked, nothing twice
    assert results[0].score() == results[1].score() == 1.0
    records = cache_lines(results[0])
    assert sorted(r["item_id"] for r in records) == sorted(it.item_id for it in bench.items)
    generated = [r.summary["generated_this_call"] for r in results]
    assert generated == seen
    claims = json.loads((results[0].run_dir / "generations.claims.json").read_text())
    assert claims == []


PROCESS_RUN = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_reliability_eval_cache import SETTINGS, SlowCandidate, toy_benchmark
from mergelab.eval import evaluate

cache, me = Path(sys.argv[1]), sys.argv[3]
bench = toy_benchmark(16)
cand = SlowCandidate(bench, delay=0.1)
(cache / f"ready-{me}").touch()
while len(list(cache.glob("ready-*"))) < 2:  # start together
    time.sleep(0.01)
evaluate(cand, bench, SETTINGS, cache_dir=cache, progress=False)
print(json.dumps(len(cand.seen)))
"""


def test_two_processes_on_one_cache_share_the_work(tmp_path):
    here = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS_RUN, str(tmp_path), here, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    counts = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        counts.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(counts) == 16, counts  # every item generated once in all
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    lines = (run_dir / "generations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["item_id"] for r in records) == sorted(f"toy/{i}" for i in range(16))


def test_read_generations_is_what_a_resume_keeps(tmp_path):
    """The public reader: complete records by (item_id, sample) in file order, a record written
    again later wins, a broken line and a torn last line are skipped without a warning."""
    from mergelab.eval import read_generations

    def rec(item, sample, text):
        return {"item_id": item, "sample": sample, "text": text, "finish_reason": "eos"}

    path = tmp_path / "generations.jsonl"
    lines = [rec("a", 0, "1"), rec("b", 0, "2"), {"item_id": "c"}, rec("a", 0, "3")]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in lines)
        + "not json\n"
        + json.dumps(rec("d", 0, "4"))[:9]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = read_generations(path)
    assert list(got) == [("a", 0), ("b", 0)]
    assert got[("a", 0)]["text"] == "3" and got[("b", 0)]["text"] == "2"
    assert read_generations(tmp_path / "missing.jsonl") == {}
