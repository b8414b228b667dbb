"""Expanding a spec: benchmarks split per seed, families × grid points, and the jobs (one
candidate on one benchmark split) of the two phases — validation (to choose), then test.

Splits are resolved before anything runs and recorded (every item id); a validation and a test
split that share an item are refused. Nothing here loads a model.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergelab.compare.spec import BenchmarkSpec, CompareSpec, Family, SpecError
from mergelab.errors import UserInputError
from mergelab.eval.benchmarks import Benchmark, read_records


@dataclass(frozen=True)
class Point:
    """One candidate: a family at one grid point. ``row`` names its row in the table (the
    family's name, or the expert's); ``label`` names the grid point (``lambda=0.5,density=0.2``)."""

    family: Family
    row: str
    params: dict[str, Any] = field(default_factory=dict)
    expert: str | None = None  # for the expert family

    @property
    def label(self) -> str:
        return ",".join(f"{k}={_show(v)}" for k, v in self.params.items())

    @property
    def candidate_name(self) -> str:
        """The candidate's name (it is part of the generation cache key)."""
        return candidate_name(self.row, self.label)

    def to_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "family": self.family.family,
            "label": self.label,
            "params": self.params,
        }


def made_of(family: Family, models: Mapping[str, Any], expert: str | None = None) -> dict[str, Any]:
    """What a row is made of: each model it uses and how (a full model, a LoRA adapter in ΔW
    space, or an adapter merged into a copy of the base), the formula or merge method, fixed
    parameters and weights, and the grid its point is chosen from. ``models`` are the spec's
    (name → ModelSource); ``expert`` names the row of an expert family."""
    fam = family.family
    lora = fam.startswith("lora_")

    def how(name: str) -> str:
        if family.path is not None:
            return "model (saved composition)"
        source = models.get(name)
        if source is None or source.kind != "adapter":
            return "model"
        return "LoRA adapter (ΔW)" if lora else "LoRA adapter merged into the base"

    if fam == "base":
        names = ["base"]
    elif fam == "expert":
        names = [expert] if expert is not None else list(family.experts)
    elif fam in ("merge", "lora_merge") and not family.use_base:
        names = list(family.experts)
    else:
        names = ["base", *family.experts]
    out: dict[str, Any] = {"models": {n: how(n) for n in names}}
    if family.path is not None:
        out["saved"] = family.path
    if fam in ("composition", "lora_composition"):
        out["formula"] = _formula(family)
        out["eos_policy"] = family.eos_policy
    if family.method is not None:
        out["method"] = family.method
    if family.params:
        out["params"] = dict(family.params)
    if family.weights is not None:
        out["weights"] = list(family.weights)
    if family.grid:
        out["grid"] = {k: list(v) for k, v in family.grid.items()}
    return out


def _formula(family: Family) -> str:
    from mergelab.compose.formula import Composition

    if family.composition is not None:
        return str(Composition.from_dict(family.composition))
    if {"weight", "weights"} & set(family.grid):
        terms = " + ".join(f"w·({e} − base)" for e in family.experts)
        return f"base + {terms}, w from the grid"
    return str(Composition.weighted("base", list(family.experts), family.weights))


def made_of_text(parts: Mapping[str, Any]) -> str:
    """One line from :func:`made_of`: ``base, math, code (LoRA adapter merged into the base);
    ties; params density=0.2; grid lambda [0.5, 1.0]``."""
    shown = [n if k == "model" else f"{n} ({k})" for n, k in parts["models"].items()]
    text = ", ".join(shown)
    if "formula" in parts:
        text += f"; {parts['formula']}"
        if parts.get("eos_policy", "plain") != "plain":
            text += f", eos_policy {parts['eos_policy']}"
    if "method" in parts:
        text += f"; {parts['method']}"
    if "saved" in parts:
        text += f"; saved at {parts['saved']}"
    if parts.get("params"):
        text += "; params " + ", ".join(f"{k}={_show(v)}" for k, v in parts["params"].items())
    if parts.get("weights"):
        text += f"; weights {_show(parts['weights'])}"
    if parts.get("grid"):
        text += "; grid " + ", ".join(f"{k} {_show(v)}" for k, v in parts["grid"].items())
    return text


def candidate_name(row: str, label: str) -> str:
    """A candidate's name from its row and grid-point label: ``ties[lambda=0.5,density=0.2]``,
    or the row alone for a point without parameters. Jobs' records carry ``row`` and ``label``;
    this is the one place that joins them."""
    return f"{row}[{label}]" if label else row


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, tuple)) else str(v)


@dataclass(frozen=True)
class Job:
    """One candidate evaluated on one split of one benchmark, for one seed."""

    seed: int
    point: Point
    benchmark: str
    split: str  # "validation" | "test"


@dataclass
class Plan:
    """What a run will do. ``splits[seed][benchmark]`` holds ``validation`` (or None) and
    ``test`` item ids; ``tuned`` are the families whose grid is chosen on validation."""

    spec: CompareSpec
    benchmarks: dict[str, Benchmark]
    splits: dict[int, dict[str, dict[str, list[str] | None]]]

    @property
    def fixed_points(self) -> list[Point]:
        """Rows that go to test as they are: the base, each expert, one-point families."""
        out = []
        for fam in self.spec.families:
            if fam.family == "expert":
                out += [Point(fam, e, expert=e) for e in fam.experts]
            elif len(fam.points()) == 1:
                out.append(Point(fam, fam.name, fam.points()[0]))
        return out

    @property
    def tuned(self) -> list[Family]:
        return [f for f in self.spec.families if f.family != "expert" and len(f.points()) > 1]

    def grid_points(self, fam: Family) -> list[Point]:
        return [Point(fam, fam.name, p) for p in fam.points()]

    @property
    def expert_points(self) -> list[Point]:
        """The experts that compete to be each benchmark's best single expert (evaluated on
        validation); an expert family with ``best_expert: false`` only adds test rows."""
        return [
            p for p in self.fixed_points if p.family.family == "expert" and p.family.best_expert
        ]

    @property
    def validation_benchmarks(self) -> list[str]:
        return [b.name for b in self.spec.benchmarks if b.has_validation]

    def validation_jobs(self, seed: int) -> list[Job]:
        points = self.expert_points + [p for f in self.tuned for p in self.grid_points(f)]
        return [Job(seed, p, b, "validation") for p in points for b in self.validation_benchmarks]

    def test_jobs(self, seed: int, chosen: dict[str, Point]) -> list[Job]:
        rows = self.fixed_points + [chosen[f.name] for f in self.tuned]
        families = self.spec.families
        rows.sort(key=lambda p: families.index(p.family))  # the families' order in the spec
        return [Job(seed, p, b.name, "test") for p in rows for b in self.spec.benchmarks]

    def split_benchmark(self, seed: int, name: str, split: str) -> Benchmark:
        full = self.benchmarks[name]
        ids = self.splits[seed][name][split]
        if ids is None:
            raise ValueError(f"benchmark {name!r} has no {split} split")
        by_id = {it.item_id: it for it in full.items}
        return Benchmark(f"{name}-{split}", full.task, [by_id[i] for i in ids], full.source)

    def n_generations(self, jobs: list[Job]) -> int:
        return sum(
            len(self.splits[j.seed][j.benchmark][j.split]) * self.n_samples(j.benchmark)
            for j in jobs
        )

    def n_samples(self, benchmark: str) -> int:
        return int(self.spec.benchmark(benchmark).eval.get("n_samples", 1))

    def describe(self) -> str:
        """The expanded plan as text (``--dry-run``). Test rows of tuned families are counted
        once each (the point is chosen on validation)."""
        spec = self.spec
        lines = [
            f"compare {spec.name!r}: seeds {list(spec.seeds)}, executor {spec.executor['kind']}"
        ]
        if spec.plugins:  # loaded by every job (mergelab.plugins)
            lines.append(f"plugins: {', '.join(spec.plugins)}")
        lines.append("benchmarks (items per split, first seed):")
        s0 = spec.seeds[0]
        for b in spec.benchmarks:
            sp = self.splits[s0][b.name]
            val = (
                len(sp["validation"])
                if sp["validation"] is not None
                else (f"from {b.validation_from}" if b.validation_from else "none")
            )
            lines.append(
                f"  {b.name:20s} {self.benchmarks[b.name].task:10s} validation {val}, "
                f"test {len(sp['test'])}, samples/item {self.n_samples(b.name)}"
            )
        lines.append("candidates:")
        for fam in spec.families:
            if fam.family == "expert":
                lines.append(
                    f"  expert: {', '.join(fam.experts)} (best single expert per "
                    "benchmark chosen on validation)"
                    if fam.best_expert
                    else f"  expert: {', '.join(fam.experts)} (test rows only)"
                )
                for e in fam.experts:
                    lines.append(f"    {e}: {made_of_text(made_of(fam, spec.models, e))}")
                continue
            pts = self.grid_points(fam)
            what = fam.method or (fam.family if fam.family != fam.name else "")
            lines.append(
                f"  {fam.name} ({fam.family}{': ' + what if what and what != fam.family else ''}): "
                f"{len(pts)} grid point{'s' if len(pts) > 1 else ''}"
                + (f" — {', '.join(p.label for p in pts)}" if len(pts) > 1 else "")
            )
            lines.append(f"    made of: {made_of_text(made_of(fam, spec.models))}")
        total_val = total_test = 0
        for seed in spec.seeds:
            vjobs = self.validation_jobs(seed)
            tjobs = self.test_jobs(seed, {f.name: self.grid_points(f)[0] for f in self.tuned})
            total_val += self.n_generations(vjobs)
            total_test += self.n_generations(tjobs)
            lines.append(
                f"seed {seed}: {len(vjobs)} validation jobs ({self.n_generations(vjobs)} "
                f"generations), {len(tjobs)} test jobs ({self.n_generations(tjobs)} "
                "generations)"
            )
        merges = sum(1 for f in spec.families if f.family in ("merge", "lora_merge"))
        lines.append(
            f"total: {total_val + total_test} generations "
            f"({total_val} validation, {total_test} test); "
            f"{merges} merge famil{'y' if merges == 1 else 'ies'}"
        )
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------


def load_benchmark_spec(b: BenchmarkSpec, source: str) -> Benchmark:
    load = b.load
    if "object" in load:
        bench = load["object"]
    elif "lm_eval" in load:  # an lm-eval task, evaluated by lm-eval (eval.lm_eval_tasks)
        from mergelab.eval.lm_eval_tasks import load_lm_eval_task

        try:
            bench = load_lm_eval_task(load["lm_eval"], name=b.name)
        except ImportError as exc:
            raise SpecError(
                f"{source}: benchmarks[{b.name}].lm_eval: needs lm-eval "
                f"(pip install 'mergelab[lm_eval]'): {exc}"
            ) from None
        except (UserInputError, ValueError) as exc:
            raise SpecError(f"{source}: benchmarks[{b.name}]: {exc}") from exc
    elif "fields" in load:  # a generic task over the user's records (eval.generic_tasks)
        from mergelab.eval.benchmarks import BenchmarkFormatError
        from mergelab.eval.generic_tasks import load_generic

        try:
            bench = load_generic(
                load["file"],
                task=load["task"],
                fields=load["fields"],
                split=load.get("dataset_split"),
                name=b.name,
            )
        except BenchmarkFormatError as exc:  # names the file, line and field
            raise SpecError(f"{source}: benchmarks[{b.name}]: {exc}") from exc
    elif "file" in load:
        records = [rec for _, rec in read_records(load["file"])]
        try:
            bench = Benchmark.from_items(b.name, load["task"], records)
        except TypeError as exc:  # a record with fields an Item does not have
            raise SpecError(
                f"{source}: benchmarks[{b.name}].file: {load['file']}: records of task "
                f"{load['task']!r} have the fields item_id, prompt, answer (and solution, tests, "
                f"meta); for your own fields use task: exact_match, normalized_match, regex, "
                f"multiple_choice or code_tests with fields: (docs/compare.md, 'Your own data') — {exc}"
            ) from exc
        except ValueError as exc:
            raise SpecError(f"{source}: benchmarks[{b.name}].file: {load['file']}: {exc}") from exc
        bench.source = load["file"]
    else:
        from mergelab.eval.tasks import load_benchmark

        bench = load_benchmark(load["benchmark"], load.get("path"))
    if not bench.items:
        raise SpecError(f"{source}: benchmarks[{b.name}]: no items")
    return bench


def resolve_split(b: BenchmarkSpec, bench: Benchmark, seed: int, source: str) -> dict[str, Any]:
    """Item ids of the validation and test splits for ``seed`` (a count draws with
    ``split.seed`` if given, else with the run's seed)."""
    key = f"{source}: benchmarks[{b.name}].split"
    ids = [it.item_id for it in bench.items]
    known = set(ids)

    def explicit(part: str, values: list) -> list[str]:
        values = [str(v) for v in values]
        missing = [v for v in values if v not in known]
        if missing:
            raise SpecError(
                f"{key}.{part}: {len(missing)} id(s) not in benchmark {bench.name!r}: {missing[:5]}"
            )
        if len(set(values)) != len(values):
            raise SpecError(f"{key}.{part}: an item id is listed twice")
        return values

    rng = random.Random(b.split_seed if b.split_seed is not None else seed)
    shuffled = rng.sample(ids, len(ids))
    val, test = b.split_validation, b.split_test
    out: dict[str, list[str] | None] = {"validation": None, "test": None}
    if isinstance(val, list):
        out["validation"] = explicit("validation", val)
    if isinstance(test, list):
        out["test"] = explicit("test", test)
    for part, value in (("validation", val), ("test", test)):
        if isinstance(value, int):
            taken = set(out["validation"] or ()) | set(out["test"] or ())
            pool = [i for i in shuffled if i not in taken]
            if value > len(pool):
                raise SpecError(
                    f"{key}.{part}: {value} items asked, {len(pool)} available in {bench.name!r}"
                )
            out[part] = pool[:value]
    for part, value in (("validation", val), ("test", test)):
        if value in ("rest", "all"):
            other = set(out["test" if part == "validation" else "validation"] or ())
            out[part] = [i for i in ids if i not in other]
    if not out["test"]:
        raise SpecError(f"{key}.test: empty")
    overlap = set(out["validation"] or ()) & set(out["test"])
    if overlap:
        raise SpecError(
            f"{key}: validation and test share {len(overlap)} item(s): {sorted(overlap)[:5]}"
        )
    return out


def make_plan(spec: CompareSpec) -> Plan:
    """Load every benchmark and resolve its splits for every seed."""
    benchmarks = {b.name: load_benchmark_spec(b, spec.source) for b in spec.benchmarks}
    splits = {
        seed: {
            b.name: resolve_split(b, benchmarks[b.name], seed, spec.source) for b in spec.benchmarks
        }
        for seed in spec.seeds
    }
    return Plan(spec, benchmarks, splits)


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()
