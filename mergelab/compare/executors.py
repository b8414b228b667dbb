"""Running jobs (one candidate on one benchmark split): in this process, or as Ray tasks.

A job's record — per-item scores, cost, termination — is written to
``<cache>/jobs/<key>.json`` when it finishes, the key hashing everything that decides it (the
candidate's models and grid point, the split's items, the evaluation settings, the seed). A rerun
reads finished jobs from there; an unfinished one resumes from :func:`mergelab.eval.evaluate`'s
generation cache (``<cache>/generations``), so an interrupted run loses at most one batch.

With Ray, every job is a task declaring the spec's resources (``num_cpus``, ``num_gpus``,
``resources``); tasks run the same code on the same inputs, so the records equal a local run's
(wall-clock costs aside). Ray is an optional extra: ``pip install "mergelab[ray]"``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergelab.compare.candidates import ModelStore
from mergelab.compare.plan import Job, Plan, fingerprint
from mergelab.compare.spec import eval_settings_for
from mergelab.eval import read_generations
from mergelab.outputs import atomic_output_file
from mergelab.plugins import load_plugins
from mergelab.progress import progress_bar

JOB_FORMAT = 2  # 2: costs count scored tokens (log-likelihood and lm-eval jobs)


@dataclass
class JobContext:
    """What a job needs, picklable for Ray (models load lazily in each process)."""

    plan: Plan
    store: ModelStore
    cache_dir: Path
    progress: bool = False
    sandbox: Any = None  # a running mergelab.eval.Sandbox to score code with (local runs only)

    def settings(self, job: Job):
        b = self.plan.spec.benchmark(job.benchmark)
        spec = self.plan.spec
        return eval_settings_for(
            b.generation,
            b.prompt,
            b.eval,
            seed=job.seed,
            bootstrap_samples=spec.bootstrap_samples,
            confidence=spec.confidence,
        )

    def job_key(self, job: Job) -> str:
        bench = self.plan.split_benchmark(job.seed, job.benchmark, job.split)
        fam = job.point.family
        return fingerprint(
            {
                "format": JOB_FORMAT,
                "seed": job.seed,
                "family": fam.to_dict(),
                "point": job.point.to_dict(),
                "expert": job.point.expert,
                "models": self.store.identity(),
                "benchmark": bench.fingerprint(),
                "settings": self.settings(job).to_dict(),
            }
        )

    def job_file(self, job: Job) -> Path:
        return self.cache_dir / "jobs" / f"{self.job_key(job)}.json"


def run_job(ctx: JobContext, job: Job) -> dict[str, Any]:
    """Evaluate one job (or read its finished record). The spec's plugins are loaded first
    (once per process): a Ray worker needs no setup hook to know their methods and tasks."""
    load_plugins(ctx.plan.spec.plugins)
    path = ctx.job_file(job)
    if path.is_file():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:  # a torn file cannot happen (atomic write), but be safe
            pass
        else:
            return in_split_order(record, ctx.plan.splits[job.seed][job.benchmark][job.split])
    from mergelab.eval.harness import evaluate

    candidate = ctx.store.candidate(job.point, job.seed)
    bench = ctx.plan.split_benchmark(job.seed, job.benchmark, job.split)
    result = evaluate(
        candidate,
        bench,
        ctx.settings(job),
        cache_dir=ctx.cache_dir / "generations",
        progress=ctx.progress and sys.stderr.isatty(),  # per-item bars only on a terminal
        sandbox=ctx.sandbox,
    )
    record = job_record(job, result, candidate)
    with atomic_output_file(path, force=True) as tmp:
        tmp.write_text(json.dumps(record), encoding="utf-8")
    return record


def in_split_order(record: dict[str, Any], ids: Sequence[str]) -> dict[str, Any]:
    """``record`` with its per-item scores in the split's order, the order a fresh run produces:
    the bootstrap resamples positions, so a record read back (job files written by earlier
    versions sorted their keys) must present its items in that order for a resumed run to
    report the same statistics as an uninterrupted one."""
    items = record["items"]
    return {**record, "items": {i: items[i] for i in ids if i in items}}


def job_record(job: Job, result, candidate) -> dict[str, Any]:
    """Per-item scores of the primary metric, cost and termination of one evaluation.

    Cost: ``model_evaluations_per_token`` — component models run per decoding step (1 for a
    model or merge, k + 1 for a composition of k experts; the LoRA fast path runs them as one
    batched forward); ``tokens_counted`` — what the per-token numbers count: ``"generated"``
    tokens (generation), ``"scored"`` tokens (log-likelihood scoring: the continuation tokens
    of every choice, or of lm-eval's requests), or ``"generated+scored"`` (an lm-eval task with
    both); ``tokens_per_item`` — those tokens per item (all its samples); ``ms_per_token`` —
    wall time of the model per counted token (a batch's time split evenly over its rows; timings
    depend on the machine and its load, outcomes do not); ``ms_per_item``;
    ``forward_calls_per_token`` — forward calls per counted token; ``mean_new_tokens`` —
    generated tokens per sample (0 when nothing is generated). Token counts and times of
    scoring records written before they were recorded are None."""
    metric = result.primary_metric
    wanted = {it["item_id"] for it in result.items}
    records = read_generations(result.run_dir / "generations.jsonl")
    gens = [g for (item_id, _), g in records.items() if item_id in wanted]
    generated = sum(g["n_tokens"] for g in gens)
    scored = sum(g.get("n_scored_tokens", 0) for g in gens)
    tokens = generated + scored
    seconds = sum(g["seconds"] for g in gens)
    scoring = [g for g in gens if g["finish_reason"] in ("loglikelihood", "lm_eval")]
    # a scoring record from before scored tokens were counted: its cost is unknown
    unknown = any("n_scored_tokens" not in g for g in scoring)
    counted = (
        "generated+scored"
        if generated and scored
        else "scored"
        if scored or scoring
        else "generated"
    )
    texts = [s["text"] for it in result.items for s in it["samples"]]
    per_item = {it["item_id"]: float(it["scores"][metric]) for it in result.items}
    components = getattr(getattr(candidate, "composition", None), "components", ("model",))
    return {
        "seed": job.seed,
        "row": job.point.row,
        "family": job.point.family.family,
        "label": job.point.label,
        "params": job.point.params,
        "benchmark": job.benchmark,
        "split": job.split,
        "metric": metric,
        "mean": sum(per_item.values()) / len(per_item),
        "items": per_item,
        "completions_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
        "cost": {
            "model_evaluations_per_token": len(components),
            "tokens_counted": counted,
            "tokens_per_item": None if unknown else tokens / max(1, len(per_item)),
            "forward_calls_per_token": None
            if unknown
            else sum(g["forward_passes"] for g in gens) / max(1, tokens),
            "ms_per_token": None if unknown else 1000.0 * seconds / max(1, tokens),
            "ms_per_item": 1000.0 * seconds / max(1, len(per_item)),
            "mean_new_tokens": generated / max(1, len(gens)),
        },
        "termination": {
            "stop_rate": sum(g["finish_reason"] != "length" for g in gens) / max(1, len(gens)),
            "eos_rate": sum(g["finish_reason"] == "eos" for g in gens) / max(1, len(gens)),
        },
        # where each item's first sample stopped: [new tokens, "eos" | "stop" | "length"]
        "stops": {
            it["item_id"]: [
                records[it["item_id"], 0]["n_tokens"],
                records[it["item_id"], 0]["finish_reason"],
            ]
            for it in result.items
            if (it["item_id"], 0) in records
        },
    }


# ----------------------------------------------------------------------------------------------


def run_local(ctx: JobContext, jobs: Sequence[Job], desc: str) -> list[dict[str, Any]]:
    out = []
    bar = progress_bar(jobs, desc=desc, enabled=ctx.progress, unit="job")
    for job in bar:
        bar.set_postfix_str(f"{job.point.candidate_name} · {job.benchmark}", refresh=False)
        out.append(run_job(ctx, job))
    return out


def _ray_task(ctx: JobContext, job: Job) -> dict[str, Any]:
    ctx.progress = False  # bars from many workers would interleave
    return run_job(ctx, job)


def run_ray(ctx: JobContext, jobs: Sequence[Job], desc: str) -> list[dict[str, Any]]:
    """Each job as a Ray task (connects to ``executor.address``, or starts a local instance)."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the Ray executor needs Ray: pip install 'mergelab[ray]'") from exc
    ex = ctx.plan.spec.executor
    if not ray.is_initialized():
        ray.init(address=ex.get("address"), **ex.get("init", {}))
    finished = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):  # finished jobs are read here, not shipped
        if ctx.job_file(job).is_file():
            finished[i] = run_job(ctx, job)
        else:
            todo.append(i)
    if todo:
        task = ray.remote(
            num_cpus=ex.get("num_cpus", 1),
            num_gpus=ex.get("num_gpus", 0),
            resources=ex.get("resources") or None,
        )(_ray_task)
        ctx_ref = ray.put(JobContext(ctx.plan, ctx.store, ctx.cache_dir, False))
        refs = {task.remote(ctx_ref, jobs[i]): i for i in todo}
        bar = progress_bar(
            total=len(jobs),
            initial=len(jobs) - len(todo),
            desc=f"{desc} (ray)",
            enabled=ctx.progress,
            unit="job",
        )
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                finished[refs[ref]] = ray.get(ref)
                bar.update(1)
        bar.close()
    return finished


def run_jobs(ctx: JobContext, jobs: Sequence[Job], desc: str) -> list[dict[str, Any]]:
    kind = ctx.plan.spec.executor["kind"]
    if kind == "ray":
        return run_ray(ctx, jobs, desc)
    return run_local(ctx, jobs, desc)


def progress_default() -> bool:
    """Progress is on by default: a bar on a terminal, plain lines in a log
    (:mod:`mergelab.progress`)."""
    return True
