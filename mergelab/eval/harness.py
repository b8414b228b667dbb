"""One entry point: :func:`evaluate` any candidate on any benchmark, the same way.

    from mergelab.eval import EvalSettings, evaluate, load_humaneval
    result = evaluate(candidate, load_humaneval(), EvalSettings(), cache_dir="results/eval_cache")
    result.summary["metrics"]["pass@1_base"]   # {"mean": ..., "low": ..., "high": ..., "n": ...}

Generations are cached on disk under ``cache_dir/<benchmark>-<key>/generations.jsonl``, where
the key hashes ``candidate.describe()``, the benchmark's content and every setting that changes
what is generated (prompt, decoding, number of samples). Each batch is appended and fsynced as
soon as it is generated, so a crash or Ctrl-C loses at most one batch and a rerun generates only
what is missing. A record that is not a complete generation (a line torn by a crash, ``null``, an
object without ``text``) is dropped with a :class:`CacheRecordWarning` naming the file and line,
and regenerated.

Runs on one cache share it: every read-decide-append step holds an ``flock`` on
``generations.jsonl.lock``, and each run claims the batch it is generating in
``generations.claims.json`` (with its pid and host), so two runs split the missing items between
them instead of both generating all of them; a claim of a process that has died is ignored.

Scoring (extraction, sandboxed execution) is redone from the cached text on every call; results
are written as ``items.jsonl`` + ``summary.json``, each atomically. An ``output_dir`` is checked
(exists without ``force``, not a mergelab output, overlaps the cache) before anything is generated.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mergelab.candidate import Candidate, Generation, GenerationSettings
from mergelab.eval.benchmarks import Benchmark
from mergelab.eval.prompts import PromptConfig, build_prompt, stop_strings
from mergelab.eval.sandbox import (
    ISOLATION_MODES,
    Sandbox,
    SandboxLimits,
    check_memory_limit,
    check_packages,
)
from mergelab.eval.scoring_math import MATH_CHECKERS
from mergelab.eval.stats import bootstrap_ci
from mergelab.eval.tasks import get_task
from mergelab.outputs import (
    atomic_output_dir,
    atomic_output_file,
    check_output_path,
    owner_is_gone,
    owner_record,
)

from ..progress import progress_bar

try:  # POSIX; elsewhere runs on one cache are not coordinated
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

CACHE_FORMAT = 1
# A run with nothing left to claim looks again this often for items other runs are generating.
CLAIM_POLL_SECONDS = 0.5
# A claim by a process on another host (whose liveness we cannot see) lapses after this long.
FOREIGN_CLAIM_SECONDS = 3600.0


class CacheRecordWarning(UserWarning):
    """A generation-cache record was dropped (it will be regenerated)."""


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides how a candidate is evaluated.

    ``generation``: decoding (greedy, 512 new tokens by default, as in the paper); the
    benchmark's stop strings are added to ``generation.stop_strings``. ``n_samples``
    completions per item (sample ``j`` decodes with seed ``generation.seed + j``); ``pass_k``:
    the k of pass@k for code (each ≤ n_samples). ``gsm8k_extraction``: "flexible" or
    "strict". ``math_checker``: how MATH answers are compared — "hybrid" (math-verify, plus
    MATH's string normalisation where math-verify misses), "math-verify" or "mergelab" (see
    :mod:`mergelab.eval.scoring_math` and docs/evaluators.md). ``sandbox``: limits per test
    program; ``workers``: parallel programs;
    ``isolation``: "namespaces" (the default: refused where the kernel has none) or "weak"
    (resource limits only; see :mod:`mergelab.eval.sandbox`). ``memory_limit``: "job" (default:
    a cgroup per job where one can be made, else polled), "cgroup", "polled" or "process";
    ``packages``: import names test programs may import (docs/sandbox.md).
    ``bootstrap_samples``/``confidence``/``seed``: the CIs.
    """

    generation: GenerationSettings = GenerationSettings(max_new_tokens=512)
    prompt: PromptConfig = PromptConfig()
    n_samples: int = 1
    pass_k: tuple[int, ...] = (1,)
    gsm8k_extraction: str = "flexible"
    math_checker: str = "hybrid"
    sandbox: SandboxLimits = SandboxLimits()
    workers: int | None = None
    isolation: str = "namespaces"
    memory_limit: str = "job"
    packages: tuple[str, ...] = ()
    bootstrap_samples: int = 10_000
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples]
        if bad:
            raise ValueError(f"pass_k {bad} need 1 <= k <= n_samples ({self.n_samples})")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"isolation must be one of {sorted(ISOLATION_MODES)}, got {self.isolation!r}"
            )
        check_memory_limit(self.memory_limit)
        object.__setattr__(self, "packages", check_packages(self.packages))
        if self.gsm8k_extraction not in ("flexible", "strict"):
            raise ValueError("gsm8k_extraction must be 'flexible' or 'strict'")
        if self.math_checker not in MATH_CHECKERS:
            raise ValueError(
                f"math_checker must be one of {MATH_CHECKERS}, got {self.math_checker!r}"
            )
        if self.n_samples > 1 and not self.generation.do_sample:
            raise ValueError(
                "n_samples > 1 with greedy decoding gives identical samples; "
                "set generation.do_sample=True"
            )

    def generation_key(self) -> dict[str, Any]:
        """The settings that change what is generated (and so key the generation cache)."""
        return {
            "generation": self.generation.to_dict(),
            "prompt": self.prompt.to_dict(),
            "n_samples": self.n_samples,
        }

    def to_dict(self) -> dict[str, Any]:
        # The sandbox's memory_limit and packages only where set: keys of earlier runs stay.
        sandbox_options = {
            k: v
            for k, v in (("memory_limit", self.memory_limit), ("packages", list(self.packages)))
            if v not in ("job", [])
        }
        return {
            **self.generation_key(),
            "pass_k": list(self.pass_k),
            "gsm8k_extraction": self.gsm8k_extraction,
            "math_checker": self.math_checker,
            "sandbox": self.sandbox.to_job(),
            "workers": self.workers,
            "isolation": self.isolation,
            **sandbox_options,
            "bootstrap_samples": self.bootstrap_samples,
            "confidence": self.confidence,
            "seed": self.seed,
        }


@dataclass
class EvalResult:
    """``summary``: metrics with CIs plus the full config; ``items``: one dict per item with
    ``item_id``, ``scores`` (per-item value of each metric), ``samples`` (text, extracted answer
    or test statuses). ``run_dir``: the cache folder; ``output_dir``: where files were written."""

    summary: dict[str, Any]
    items: list[dict[str, Any]]
    run_dir: Path
    output_dir: Path
    primary_metric: str = field(default="accuracy")

    def score(self, metric: str | None = None) -> float:
        return self.summary["metrics"][metric or self.primary_metric]["mean"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text)[:60] or "benchmark"


def cache_key(candidate: Candidate, benchmark: Benchmark, settings: EvalSettings) -> str:
    """sha256 over the candidate's description, the benchmark's content and the settings."""
    payload = {
        "format": CACHE_FORMAT,
        "candidate": candidate.describe(),
        "benchmark": {"name": benchmark.name, "fingerprint": benchmark.fingerprint()},
        "settings": settings.generation_key(),
    }
    blob = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


def _record_problem(rec: Any) -> str | None:
    """Why ``rec`` is not a complete cache record (None if it is one)."""
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not an object"
    for key, kind in (("item_id", str), ("text", str), ("finish_reason", str)):
        if not isinstance(rec.get(key), kind):
            return f"no string {key!r}"
    sample = rec.get("sample")
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        return "no sample number"
    return None


def _read_cache(path: Path, warn: bool = True) -> tuple[dict[tuple[str, int], dict], int]:
    """Valid records by (item_id, sample), later ones winning, and the number of bad lines.

    A last line without its newline is one being written (or cut by a crash): skipped silently.
    Any other line that is not a complete record is dropped with a warning naming file and line.
    """
    done: dict[tuple[str, int], dict[str, Any]] = {}
    bad = 0
    if not path.exists():
        return done, bad
    data = path.read_bytes()
    lines = data.split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip() or (n == len(lines) and not data.endswith(b"\n")):
            continue
        try:
            rec = json.loads(raw)
            problem = _record_problem(rec)
        except (json.JSONDecodeError, UnicodeDecodeError):
            problem = "not valid JSON"
        if problem is not None:
            bad += 1
            if warn:
                warnings.warn(
                    f"{path}:{n}: dropped a cache record that is not a complete generation "
                    f"({problem}); it will be regenerated",
                    CacheRecordWarning,
                    stacklevel=3,
                )
            continue
        done[(rec["item_id"], rec["sample"])] = rec
    return done, bad


def read_generations(path: str | Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The complete generation records of a run's ``generations.jsonl``, by
    ``(item_id, sample)`` in file order (a record written again later wins; a torn or broken
    line is skipped) — what :func:`evaluate` itself resumes from."""
    return _read_cache(Path(path), warn=False)[0]


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left incomplete by a crash mid-write, so appends start on a new line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


@contextmanager
def _cache_lock(cache_file: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``<cache>.lock`` (released by the OS if the process dies)."""
    if fcntl is None:
        yield
        return
    with open(cache_file.with_name(cache_file.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _repair_cache(cache_file: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Read the cache, warning about bad records; if there are any, rewrite it (atomically, under
    the lock) with the valid records only, so later runs neither warn again nor trip on them."""
    done, bad = _read_cache(cache_file)
    if bad:
        with _cache_lock(cache_file):
            done, bad = _read_cache(cache_file, warn=False)
            if bad:
                with atomic_output_file(cache_file) as tmp:
                    tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    return done


def _claims_file(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.stem + ".claims.json")


def _live_claims(cache_file: Path, done, own: str) -> list[dict[str, Any]]:
    """Other runs' claims that still matter: owner alive, and some claimed item not yet done."""
    try:
        claims = json.loads(_claims_file(cache_file).read_text())
    except (OSError, ValueError):
        return []
    live = []
    for claim in claims if isinstance(claims, list) else []:
        if not isinstance(claim, dict) or claim.get("token") == own:
            continue
        owner = claim.get("owner")
        if not isinstance(owner, dict):
            continue
        foreign = owner.get("host") != owner_record()["host"]
        since = claim.get("time")
        age = time.time() - since if isinstance(since, (int, float)) else float("inf")
        lapsed = foreign and age > FOREIGN_CLAIM_SECONDS
        if owner_is_gone(owner) or lapsed:
            continue
        jobs = [tuple(j) for j in claim.get("jobs", []) if isinstance(j, list) and len(j) == 2]
        if any(j not in done for j in jobs):
            live.append({**claim, "jobs": [list(j) for j in jobs]})
    return live


def _write_claims(cache_file: Path, claims: list[dict[str, Any]]) -> None:
    with atomic_output_file(_claims_file(cache_file)) as tmp:
        tmp.write_text(json.dumps(claims))


def _generate_missing(
    candidate: Candidate,
    jobs: list[tuple[str, int, str]],
    settings: EvalSettings,
    gen_settings: GenerationSettings,
    cache_file: Path,
    progress: bool,
    desc: str,
    continuations: dict[str, list[str]] | None = None,
    run_items: Any = None,
) -> int:
    """Generate (item_id, sample, prompt) jobs in batches, appending each batch to the cache;
    returns how many this call generated.

    Under the cache lock each round re-reads the cache, skips what is done or claimed by another
    live run, claims the next batch, and later appends it. With nothing left to claim it waits
    for the other runs' batches (or for their death, which frees their claims).
    """
    # A task run outside the decoding loop (lm-eval) evaluates every missing item in one call.
    batch = len(jobs) if run_items is not None else max(1, gen_settings.batch_size)
    token = uuid.uuid4().hex
    # Longest prompts first (as lm-eval orders its requests): a batch holds prompts of similar
    # length, so left padding wastes little, and a batch too large for memory fails early.
    ordered = sorted(jobs, key=lambda job: -len(job[2]))
    wanted = {(item_id, s): (item_id, s, p) for item_id, s, p in ordered}
    bar = progress_bar(total=len(jobs), desc=desc, unit="item", enabled=progress)
    made, waited = 0, False
    try:
        while True:
            with _cache_lock(cache_file):
                done, _ = _read_cache(cache_file, warn=False)
                claims = _live_claims(cache_file, done, token)
                claimed = {tuple(j) for c in claims for j in c["jobs"]}
                missing = [job for key, job in wanted.items() if key not in done]
                chunk = [job for job in missing if job[:2] not in claimed][:batch]
                if chunk:
                    mine = {
                        "token": token,
                        "owner": owner_record(),
                        "time": time.time(),
                        "jobs": [list(job[:2]) for job in chunk],
                    }
                    claims.append(mine)
                _write_claims(cache_file, claims)
            bar.update(len(jobs) - len(missing) - bar.n)
            if not missing:
                break
            if not chunk:
                if not waited and progress:
                    owners = sorted({f"pid {c['owner'].get('pid')}" for c in claims})
                    print(
                        f"waiting for items another run is generating ({', '.join(owners)})",
                        file=sys.stderr,
                    )
                waited = True
                time.sleep(CLAIM_POLL_SECONDS)
                continue
            if run_items is not None:
                lines = _run_items_batch(candidate, chunk, run_items, progress)
            elif continuations is not None:
                lines = _score_batch(candidate, chunk, continuations)
            else:
                lines = _generate_batch(candidate, chunk, settings, gen_settings)
            with _cache_lock(cache_file):
                _drop_torn_tail(cache_file)
                with open(cache_file, "a", encoding="utf-8") as f:
                    f.write("".join(json.dumps(rec) + "\n" for rec in lines))
                    f.flush()
                    os.fsync(f.fileno())
            made += len(chunk)
    finally:
        bar.close()
        with _cache_lock(cache_file):  # give back a claim this run did not fulfil
            done, _ = _read_cache(cache_file, warn=False)
            _write_claims(cache_file, _live_claims(cache_file, done, token))
    return made


def _generate_batch(
    candidate: Candidate,
    chunk: list[tuple[str, int, str]],
    settings: EvalSettings,
    gen_settings: GenerationSettings,
) -> list[dict[str, Any]]:
    """Cache records for one batch of jobs (grouped by sample: each sample has its own seed)."""
    by_sample: dict[int, list[tuple[str, int, str]]] = {}
    for job in chunk:
        by_sample.setdefault(job[1], []).append(job)
    lines = []
    for sample, group in sorted(by_sample.items()):
        seed = None if gen_settings.seed is None else gen_settings.seed + sample
        if gen_settings.do_sample and seed is None:
            seed = settings.seed + sample
        gens = candidate.generate([p for _, _, p in group], replace(gen_settings, seed=seed))
        if len(gens) != len(group):
            raise RuntimeError(
                f"candidate {candidate.name!r} returned {len(gens)} generations "
                f"for {len(group)} prompts"
            )
        for (item_id, s, prompt), gen in zip(group, gens):
            lines.append(_cache_record(item_id, s, prompt, gen))
    return lines


def _run_items_batch(
    candidate: Candidate, chunk, run_items, progress: bool
) -> list[dict[str, Any]]:
    """Cache records of a task that evaluates its items itself (``Task.run_items``; given
    ``progress`` when it takes it)."""
    items, by_id = run_items
    todo = [by_id[i] for i in dict.fromkeys(i for i, _, _ in chunk)]
    takes_progress = "progress" in inspect.signature(items).parameters
    records = (
        items(candidate, todo, progress=progress) if takes_progress else items(candidate, todo)
    )
    return [
        {
            **records[item_id],
            "item_id": item_id,
            "sample": sample,
            "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
        }
        for item_id, sample, prompt in chunk
    ]


def _score_batch(
    candidate: Candidate, chunk: list[tuple[str, int, str]], continuations: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """Cache records of a log-likelihood task: each item's continuations scored after its
    prompt in one call; ``text`` is the most likely one (the first of equals)."""
    prompts = [p for item_id, _, p in chunk for _ in continuations[item_id]]
    conts = [c for item_id, _, _ in chunk for c in continuations[item_id]]
    t0 = time.time()
    scores = candidate.score(prompts, conts)
    seconds = (time.time() - t0) / max(1, len(chunk))
    encode = getattr(candidate, "encode_continuation", None) or (
        lambda text: candidate.tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    lines, at = [], 0
    for item_id, sample, prompt in chunk:
        k = len(continuations[item_id])
        lls = [float(x) for x in scores[at : at + k]]
        at += k
        best = max(range(k), key=lambda i: (lls[i], -i))
        lines.append(
            {
                "item_id": item_id,
                "sample": sample,
                "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
                "text": continuations[item_id][best],
                "finish_reason": "loglikelihood",
                "loglikelihoods": lls,
                "n_tokens": 0,  # generated: none
                # the tokens whose log-probs were summed, every choice's (the item's cost)
                "n_scored_tokens": sum(len(encode(c)) for c in continuations[item_id]),
                "seconds": seconds,
                "forward_passes": k,
            }
        )
    return lines


def _cache_record(item_id: str, sample: int, prompt: str, gen: Generation) -> dict[str, Any]:
    return {
        "item_id": item_id,
        "sample": sample,
        "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
        "text": gen.text,
        "finish_reason": gen.finish_reason,
        "n_tokens": len(gen.token_ids),
        "seconds": gen.seconds,
        "forward_passes": gen.forward_passes,
    }


def evaluate(
    candidate: Candidate,
    benchmark: Benchmark,
    settings: EvalSettings | None = None,
    cache_dir: str | os.PathLike = "results/eval_cache",
    limit: int | None = None,
    output_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    sandbox: Sandbox | None = None,
) -> EvalResult:
    """Evaluate ``candidate`` on (the first ``limit`` items of) ``benchmark``.

    Resumes from ``cache_dir``: items already generated with the same candidate, benchmark and
    settings are not regenerated. Results go to ``output_dir`` (refused if it exists unless
    ``force``) or, by default, to ``<run dir>/results`` (replaced on every call). Pass a
    ``sandbox`` to reuse worker processes across calls.
    """
    settings = settings or EvalSettings()
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a number of items ≥ 1 (None for all), got {limit!r}")
    if output_dir is not None:  # refused before anything is generated
        source = [benchmark.source] if os.path.exists(benchmark.source) else []
        check_output_path(output_dir, force=force, inputs=[cache_dir, *source])
    key = cache_key(candidate, benchmark, settings)
    bench = benchmark.head(limit)
    run_dir = Path(cache_dir) / f"{_slug(benchmark.name)}-{key[:16]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "candidate": candidate.describe(),
        "benchmark": benchmark.describe(),
        "settings": settings.to_dict(),
        "cache_key": key,
    }
    config_file = run_dir / "config.json"
    if not config_file.exists():
        with atomic_output_file(config_file) as tmp:
            tmp.write_text(json.dumps(config, indent=1, sort_keys=True, default=repr))

    tokenizer = getattr(candidate, "tokenizer", None)
    stops = tuple(settings.generation.stop_strings) + tuple(
        s
        for s in stop_strings(bench, settings.prompt, tokenizer)
        if s not in settings.generation.stop_strings
    )
    gen_settings = replace(settings.generation, stop_strings=stops)
    prompts = {
        it.item_id: build_prompt(it, bench, settings.prompt, tokenizer) for it in bench.items
    }

    task = get_task(bench.task)
    continuations = None
    if task.continuations is not None:  # a log-likelihood task: nothing is generated
        continuations = {it.item_id: list(task.continuations(it)) for it in bench.items}
    run_items = None
    if task.run_items is not None:  # evaluated outside the decoding loop (lm-eval)
        run_items = (task.run_items, {it.item_id: it for it in bench.items})

    cache_file = run_dir / "generations.jsonl"
    done = _repair_cache(cache_file)
    jobs = [
        (it.item_id, s, prompts[it.item_id])
        for s in range(settings.n_samples)
        for it in bench.items
        if (it.item_id, s) not in done
    ]
    t0 = time.time()
    generated = 0
    if jobs:
        desc = f"{candidate.name} · {bench.name}"
        generated = _generate_missing(
            candidate,
            jobs,
            settings,
            gen_settings,
            cache_file,
            progress,
            desc,
            continuations,
            run_items,
        )
        done, _ = _read_cache(cache_file, warn=False)
    generation_seconds = time.time() - t0

    samples = {
        it.item_id: [done[(it.item_id, s)] for s in range(settings.n_samples)] for it in bench.items
    }
    scored = task.score(bench, samples, settings, sandbox=sandbox, progress=progress)
    items, metrics, primary = scored.items, scored.metrics, scored.primary
    for it in items:
        it["prompt"] = prompts[it["item_id"]]

    summary = {
        **config,
        "n_items": len(items),
        "limit": limit,
        "primary_metric": primary,
        "metrics": {
            name: bootstrap_ci(
                values,
                n_boot=settings.bootstrap_samples,
                confidence=settings.confidence,
                seed=settings.seed,
            )
            for name, values in metrics.items()
        },
        **scored.extra,
        "generation_seconds_this_call": generation_seconds,
        "generated_this_call": generated,
    }
    out = _write_results(run_dir, output_dir, force, summary, items)
    return EvalResult(summary, items, run_dir, out, primary)


def export_evalplus_samples(
    items: list[dict[str, Any]], path: str | os.PathLike, *, force: bool = False
) -> Path:
    """Write a code evaluation's samples as EvalPlus's ``samples.jsonl`` and return its path.

    One ``{"task_id", "solution"}`` line per sample, items in order and samples in order (EvalPlus
    numbers completions by their order in the file); ``solution`` is the whole program mergelab
    tested, so ``evalplus.evaluate --dataset humaneval|mbpp --samples <path>`` runs the same code.
    ``items`` are :attr:`EvalResult.items` or the lines of a results folder's ``items.jsonl``.
    """
    lines = []
    for it in items:
        for sample in it.get("samples", []):
            if "program" not in sample:
                raise ValueError(f"item {it.get('item_id')!r} has no program: not a code result")
            lines.append(json.dumps({"task_id": it["item_id"], "solution": sample["program"]}))
    if not lines:
        raise ValueError("no code samples to export")
    with atomic_output_file(path, force=force, written_by_mergelab=_is_evalplus_samples) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)


def _is_evalplus_samples(path: Path) -> bool:
    """True for a samples file :func:`export_evalplus_samples` wrote (``--force`` may replace)."""
    try:
        records = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
    except (OSError, ValueError):
        return False
    return bool(records) and all(
        isinstance(r, dict) and set(r) == {"task_id", "solution"} for r in records
    )


def _write_results(run_dir, output_dir, force, summary, items) -> Path:
    def write(folder: Path) -> None:
        with atomic_output_file(folder / "items.jsonl") as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                for it in items:
                    f.write(json.dumps(it, default=repr) + "\n")
        with atomic_output_file(folder / "summary.json") as tmp:
            tmp.write_text(json.dumps(summary, indent=1, default=repr))

    if output_dir is None:
        out = run_dir / "results"
        out.mkdir(exist_ok=True)
        write(out)
        return out
    with atomic_output_dir(output_dir, force=force, kind="eval") as tmp:
        write(tmp)
    return Path(output_dir)
