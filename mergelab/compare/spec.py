"""The comparison spec: which models, which candidates (families × grids), which benchmarks
(validation and test splits), how to choose, how to report. One schema for a YAML file, a TOML
file and a Python dict (where models, tokenizers, benchmarks and baselines may also be objects).

    models:
      base: models/base                 # a Hugging Face folder (relative to the spec file)
      experts:
        math: models/math               # a full fine-tuned model
        code: {adapter: adapters/code}  # a PEFT LoRA adapter of the base
    candidates:
      - family: base
      - family: expert
      - family: composition
        grid: {weight: [0.5, 1.0]}
      - family: merge
        method: ties
        grid: {lambda: [0.5, 1.0], density: [0.2, 0.5]}
    benchmarks:
      - name: math
        benchmark: gsm8k
        path: data/gsm8k.jsonl
        split: {validation: 20, test: 60}   # seeded by each seed; or lists of item ids
        generation: {max_new_tokens: 64}
    seeds: [0]

docs/compare.md is the reference of every key. Every error names the key (``benchmarks[0].split``)
and the file; :class:`SpecError` is a :class:`~mergelab.errors.UserInputError` (exit code 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergelab.errors import UserInputError
from mergelab.eval.tasks import list_tasks
from mergelab.inputs import check_model_folder, parse_nested, read_config_bytes
from mergelab.vocabulary import check_merge_tokenizers

FAMILIES = ("base", "expert", "composition", "merge", "lora_composition", "lora_merge")
TOP_KEYS = {
    "name",
    "models",
    "loading",
    "candidates",
    "benchmarks",
    "selection",
    "statistics",
    "seeds",
    "executor",
    "generation",
    "prompt",
    "eval",
    "cache_dir",
    "plugins",
}
MODEL_KEYS = {"base", "tokenizer", "experts"}
MODEL_ENTRY_KEYS = {"path", "adapter"}
LOADING_KEYS = {"device", "dtype", "device_map", "max_memory", "offload_folder"}
FAMILY_KEYS = {
    "base": {"family", "name"},
    "expert": {"family", "name", "experts", "best_expert"},
    "composition": {
        "family",
        "name",
        "experts",
        "grid",
        "weights",
        "eos_policy",
        "composition",
        "prefer",
        "path",
    },
    "merge": {
        "family",
        "name",
        "method",
        "experts",
        "grid",
        "params",
        "weights",
        "prefer",
        "use_base",
    },
    "lora_composition": {"family", "name", "experts", "grid", "weights", "eos_policy", "prefer"},
    "lora_merge": {"family", "name", "method", "experts", "grid", "params", "weights", "prefer"},
}
COMPOSITION_GRID_KEYS = {"weight", "weights", "eos_policy"}
BENCHMARK_KEYS = {
    "name",
    "benchmark",
    "path",
    "file",
    "task",
    "split",
    "validation_from",
    "generation",
    "prompt",
    "eval",
    "baselines",
    "fields",
    "dataset_split",
    "lm_eval",
}
SPLIT_KEYS = {"validation", "test", "seed"}
SELECTION_KEYS = {"metric", "tie_break"}
TIE_BREAKS = ("first", "last", "closest")
STATISTICS_KEYS = {"bootstrap_samples", "confidence", "seed_interval"}
SEED_INTERVALS = ("t", "percentile")
EXECUTOR_KEYS = {"kind", "address", "num_cpus", "num_gpus", "resources", "init"}
EVAL_KEYS = {"n_samples", "pass_k", "gsm8k_extraction", "math_checker", "isolation", "workers"}
EVAL_KEYS |= {"memory_limit", "packages"}  # the sandbox's (docs/sandbox.md)


class SpecError(UserInputError):
    """A compare spec that cannot be run; the message names the key and the file."""


@dataclass(frozen=True)
class ModelSource:
    """One model of the spec: a folder, a LoRA adapter folder of the base, or an object."""

    name: str
    kind: str  # "folder" | "adapter" | "memory"
    path: str | None = None
    obj: Any = None

    def describe(self) -> dict[str, Any]:
        if self.kind == "memory":
            from mergelab.compose.vocab import model_identity

            return {"kind": "memory", **model_identity(self.obj)}
        return {"kind": self.kind, "path": self.path}


@dataclass(frozen=True)
class Family:
    """One candidate family with its grid (``grid`` maps a parameter to its values, in order)."""

    family: str
    name: str
    experts: tuple[str, ...] = ()
    method: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    weights: tuple[float, ...] | None = None
    eos_policy: str = "plain"
    composition: dict[str, Any] | None = None
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    prefer: dict[str, Any] | None = None
    best_expert: bool = True  # expert family: its experts compete to be the paired reference
    use_base: bool = True  # merge family: False merges the experts alone (base-less methods)
    path: str | None = None  # composition family: a folder saved by `mergelab compose --save`

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, in the order written (the last parameter varies fastest)."""
        out: list[dict[str, Any]] = [{}]
        for key, values in self.grid.items():
            out = [{**p, key: v} for p in out for v in values]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["grid"] = {k: list(v) for k, v in self.grid.items()}
        if d["path"] is None:  # absent unless set, so earlier runs' job keys stay valid
            del d["path"]
        return d


@dataclass(frozen=True)
class BenchmarkSpec:
    """A benchmark and how it is split. ``split_validation``/``split_test``: a list of item ids,
    a count (a seeded split), ``"rest"`` (every item not in the other split) or ``None``."""

    name: str
    load: dict[
        str, Any
    ]  # {"benchmark": name, "path": ...} | {"file": ..., "task": ...} | {"object": Benchmark}
    split_validation: Any = None
    split_test: Any = "rest"
    split_seed: int | None = None
    validation_from: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    prompt: dict[str, Any] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    baselines: Any = None  # None (all the task declares) | list of names | {name: callable}

    @property
    def has_validation(self) -> bool:
        return self.split_validation is not None


@dataclass(frozen=True)
class CompareSpec:
    """A parsed, checked spec (see the module docstring). ``raw`` is the spec as written (objects
    replaced by their descriptions), recorded in results.json."""

    models: dict[str, ModelSource]  # "base" and each expert by name
    tokenizer: Any  # a path or a tokenizer object
    families: tuple[Family, ...]
    benchmarks: tuple[BenchmarkSpec, ...]
    seeds: tuple[int, ...] = (0,)
    loading: dict[str, Any] = field(default_factory=dict)
    selection_metric: str = "mean"
    tie_break: str = "first"
    bootstrap_samples: int = 10_000
    confidence: float = 0.95
    seed_interval: str = "t"
    executor: dict[str, Any] = field(default_factory=lambda: {"kind": "local"})
    cache_dir: str | None = None
    name: str = "compare"
    source: str = "<python>"
    raw: dict[str, Any] = field(default_factory=dict)
    # Plugins (mergelab.plugins) in the form every worker loads them from: files made absolute,
    # modules with the folder they may be imported from.
    plugins: tuple[str, ...] = ()

    @property
    def experts(self) -> list[str]:
        return [n for n in self.models if n != "base"]

    def benchmark(self, name: str) -> BenchmarkSpec:
        return next(b for b in self.benchmarks if b.name == name)


# ----------------------------------------------------------------------------------------------
# Reading


def load_spec(spec: str | os.PathLike | Mapping[str, Any] | CompareSpec) -> CompareSpec:
    """A :class:`CompareSpec` from a YAML/TOML file, a dict, or one already parsed."""
    if isinstance(spec, CompareSpec):
        return spec
    if isinstance(spec, Mapping):
        return parse_spec(spec, base_dir=Path.cwd(), source="<python>")
    path = Path(spec)
    data = read_config_bytes(path, "compare spec")  # a FIFO or /dev/zero is refused unread
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte offset {exc.start})") from None
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            data = parse_nested(lambda: tomllib.loads(text), str(path))
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    else:
        import yaml

        try:
            data = parse_nested(lambda: yaml.safe_load(text), str(path))
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: a compare spec is a mapping of keys (models, candidates, ...)")
    return parse_spec(data, base_dir=path.parent.resolve(), source=str(path))


def parse_spec(
    data: Mapping[str, Any], *, base_dir: str | os.PathLike = ".", source: str = "<python>"
) -> CompareSpec:
    """Check ``data`` against the schema; every error names the key and ``source``."""
    return _Parser(Path(base_dir), source).parse(data)


def with_plugins(spec: CompareSpec, plugins: Sequence[str]) -> CompareSpec:
    """``spec`` with more plugins (already loaded here; resolved by
    :func:`mergelab.plugins.load_plugins`) for its workers to load."""
    import dataclasses

    extra = tuple(p for p in plugins if p not in spec.plugins)
    return dataclasses.replace(spec, plugins=spec.plugins + extra) if extra else spec


def with_executor(spec: CompareSpec, executor: Any) -> CompareSpec:
    """``spec`` with its executor replaced by ``executor`` ("local", "ray" or a mapping like the
    spec's ``executor`` section), checked like the spec's own. Switching a Ray spec to Ray
    (``--executor ray``, ``--ray-address``) keeps its cluster settings (address, resources per
    job, ``init``) where ``executor`` does not give them."""
    import dataclasses

    if isinstance(executor, str):
        executor = {"kind": executor}
    if spec.executor.get("kind") == "ray" and executor.get("kind", "local") == "ray":
        kept = {k: v for k, v in spec.executor.items() if v is not None}
        executor = {**kept, **{k: v for k, v in executor.items() if v is not None}}
    return dataclasses.replace(spec, executor=_Parser(Path.cwd(), "--executor").executor(executor))


class _Parser:
    def __init__(self, base_dir: Path, source: str):
        self.base_dir, self.source = base_dir, source

    def fail(self, key: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {key}: {message}")

    def mapping(self, key: str, value: Any, allowed: set[str] | None = None) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(key, f"expected a mapping, got {type(value).__name__}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise self.fail(key, f"keys must be strings, got {bad[0]!r}")
        if allowed is not None:
            unknown = sorted(set(value) - allowed)
            if unknown:
                raise self.fail(
                    f"{key}.{unknown[0]}" if key else unknown[0],
                    f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                    f"; allowed: {', '.join(sorted(allowed))}",
                )
        return dict(value)

    def path(self, key: str, value: Any) -> str:
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise self.fail(key, f"expected a path, got {value!r}")
        p = Path(os.path.expanduser(str(value)))
        return str(p if p.is_absolute() else (self.base_dir / p).resolve())

    def integer(self, key: str, value: Any, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be ≥ {minimum}, got {value}")
        return value

    def number(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(key, f"must be finite, got {value!r}")
        return float(value)

    # -- sections ------------------------------------------------------------------------------

    def parse(self, data: Mapping[str, Any]) -> CompareSpec:
        top = self.mapping("", data, TOP_KEYS)
        plugins = self.plugins(top.get("plugins"))  # first: the spec may name their methods
        for required in ("models", "candidates", "benchmarks"):
            if required not in top:
                raise self.fail(required, "missing (a spec needs models, candidates, benchmarks)")
        models, tokenizer = self.models(top["models"])
        loading = self.loading(top.get("loading"))
        defaults = {
            "generation": self.mapping("generation", top.get("generation")),
            "prompt": self.mapping("prompt", top.get("prompt")),
            "eval": self.mapping("eval", top.get("eval"), EVAL_KEYS),
        }
        benchmarks = self.benchmarks(top["benchmarks"], defaults)
        families = self.families(top["candidates"], models)
        selection = self.mapping("selection", top.get("selection"), SELECTION_KEYS)
        metric = selection.get("metric", "mean")
        names = [b.name for b in benchmarks]
        if metric != "mean" and metric not in names:
            raise self.fail(
                "selection.metric",
                f"{metric!r} is neither 'mean' nor a benchmark ({', '.join(names)})",
            )
        tie_break = selection.get("tie_break", "first")
        if tie_break not in TIE_BREAKS:
            raise self.fail("selection.tie_break", f"{tie_break!r} is not one of {TIE_BREAKS}")
        for fam in families:
            if tie_break == "closest" and len(fam.points()) > 1 and not fam.prefer:
                raise self.fail(
                    f"candidates[{fam.name}].prefer",
                    "tie_break 'closest' needs the "
                    "grid point to prefer (e.g. prefer: {lambda: 1.0})",
                )
        stats = self.mapping("statistics", top.get("statistics"), STATISTICS_KEYS)
        n_boot = self.integer(
            "statistics.bootstrap_samples", stats.get("bootstrap_samples", 10_000), minimum=100
        )
        confidence = self.number("statistics.confidence", stats.get("confidence", 0.95))
        if not 0 < confidence < 1:
            raise self.fail("statistics.confidence", f"must be in (0, 1), got {confidence}")
        seed_interval = stats.get("seed_interval", "t")
        if seed_interval not in SEED_INTERVALS:
            raise self.fail(
                "statistics.seed_interval", f"{seed_interval!r} is not one of {SEED_INTERVALS}"
            )
        seeds = top.get("seeds", [0])
        if isinstance(seeds, int) and not isinstance(seeds, bool):
            seeds = [seeds]
        if not isinstance(seeds, list) or not seeds:
            raise self.fail("seeds", f"expected a non-empty list of integers, got {seeds!r}")
        seeds = [self.integer(f"seeds[{i}]", s, minimum=0) for i, s in enumerate(seeds)]
        if len(set(seeds)) != len(seeds):
            raise self.fail("seeds", f"a seed is listed twice: {seeds}")
        needs_validation = any(
            len(f.points()) > 1 or (f.family == "expert" and f.best_expert) for f in families
        )
        if needs_validation and not any(b.has_validation for b in benchmarks):
            raise self.fail(
                "benchmarks",
                "no benchmark has a validation split, but a family has "
                "a grid (or experts) to choose on validation",
            )
        return CompareSpec(
            models=models,
            tokenizer=tokenizer,
            families=tuple(families),
            benchmarks=tuple(benchmarks),
            seeds=tuple(seeds),
            loading=loading,
            selection_metric=metric,
            tie_break=tie_break,
            bootstrap_samples=n_boot,
            confidence=confidence,
            seed_interval=seed_interval,
            executor=self.executor(top.get("executor")),
            cache_dir=self.path("cache_dir", top["cache_dir"]) if top.get("cache_dir") else None,
            name=str(top.get("name", "compare")),
            source=self.source,
            raw=_describe(data),
            plugins=plugins,
        )

    def plugins(self, value: Any) -> tuple[str, ...]:
        from mergelab.plugins import PluginError, check_list, load_plugins

        try:
            return tuple(load_plugins(check_list(value, "plugins"), self.base_dir))
        except PluginError as exc:
            raise self.fail("plugins", str(exc)) from None

    def models(self, value: Any) -> tuple[dict[str, ModelSource], Any]:
        section = self.mapping("models", value, MODEL_KEYS)
        if "base" not in section:
            raise self.fail("models.base", "missing")
        models = {"base": self.model_source("models.base", "base", section["base"])}
        if models["base"].kind == "adapter":
            raise self.fail("models.base", "the base must be a model, not an adapter")
        experts = self.mapping("models.experts", section.get("experts"))
        if not experts:
            raise self.fail("models.experts", "missing or empty (name at least one expert)")
        for name, entry in experts.items():
            if name == "base":
                raise self.fail("models.experts.base", "'base' is the base model's name")
            models[name] = self.model_source(f"models.experts.{name}", name, entry)
        tok = section.get("tokenizer")
        if tok is None:
            if models["base"].kind == "memory":
                raise self.fail("models.tokenizer", "an in-memory base needs a tokenizer object")
            tok = models["base"].path
        elif isinstance(tok, (str, os.PathLike)):
            tok = self.path("models.tokenizer", tok)
        # Every row runs with one tokenizer, and merges average rows by id: each id one token.
        folders = {n: m.path for n, m in models.items() if m.kind == "folder"}
        check_merge_tokenizers(
            list(folders.values()),
            ["models.base" if n == "base" else f"models.experts.{n}" for n in folders],
            "every candidate of a comparison runs with one tokenizer: compare models that share it",
        )
        return models, tok

    def model_source(self, key: str, name: str, entry: Any) -> ModelSource:
        if isinstance(entry, (str, os.PathLike)):
            entry = {"path": entry}
        if isinstance(entry, Mapping):
            entry = self.mapping(key, entry, MODEL_ENTRY_KEYS)
            if len(entry) != 1:
                raise self.fail(key, "give exactly one of path, adapter")
            kind, value = next(iter(entry.items()))
            path = self.path(f"{key}.{kind}", value)
            marker = "adapter_config.json" if kind == "adapter" else "config.json"
            if not (Path(path) / marker).is_file():
                raise self.fail(
                    f"{key}.{kind}",
                    f"{path} is not a {'PEFT adapter' if kind == 'adapter' else 'model'} "
                    f"folder (no {marker})",
                )
            check_model_folder(path)
            return ModelSource(name, "adapter" if kind == "adapter" else "folder", path)
        if hasattr(entry, "state_dict") and hasattr(entry, "forward"):
            return ModelSource(name, "memory", obj=entry)
        raise self.fail(
            key, f"expected a folder path, {{adapter: path}} or a model object, got {entry!r}"
        )

    def loading(self, value: Any) -> dict[str, Any]:
        section = self.mapping("loading", value, LOADING_KEYS)
        out = {"device": section.get("device", "cpu"), "dtype": section.get("dtype", "float32")}
        import torch

        if not isinstance(getattr(torch, str(out["dtype"]), None), torch.dtype):
            raise self.fail("loading.dtype", f"{out['dtype']!r} is not a torch dtype name")
        dm = section.get("device_map")
        if dm is not None and not isinstance(dm, (str, Mapping)):
            raise self.fail(
                "loading.device_map",
                "expected 'auto' (or another accelerate "
                "strategy) or a mapping of module names to devices",
            )
        out["device_map"] = dict(dm) if isinstance(dm, Mapping) else dm
        mm = section.get("max_memory")
        if mm is not None:
            mm = self.mapping("loading.max_memory", mm)
            if dm is None:
                raise self.fail("loading.max_memory", "needs loading.device_map (e.g. auto)")
        out["max_memory"] = mm
        of = section.get("offload_folder")
        out["offload_folder"] = self.path("loading.offload_folder", of) if of else None
        return out

    def executor(self, value: Any) -> dict[str, Any]:
        if isinstance(value, str):
            value = {"kind": value}
        section = self.mapping("executor", value, EXECUTOR_KEYS)
        kind = section.get("kind", "local")
        if kind not in ("local", "ray"):
            raise self.fail("executor.kind", f"{kind!r} is not 'local' or 'ray'")
        out = {"kind": kind, "address": section.get("address")}
        out["num_cpus"] = self.number("executor.num_cpus", section.get("num_cpus", 1))
        out["num_gpus"] = self.number("executor.num_gpus", section.get("num_gpus", 0))
        out["resources"] = {
            k: self.number(f"executor.resources.{k}", v)
            for k, v in self.mapping("executor.resources", section.get("resources")).items()
        }
        out["init"] = self.mapping("executor.init", section.get("init"))
        if kind == "local" and (section.keys() - {"kind"}):
            raise self.fail(
                "executor", f"{sorted(section.keys() - {'kind'})} apply to kind: ray only"
            )
        return out

    # -- candidates ----------------------------------------------------------------------------

    def families(self, value: Any, models: dict[str, ModelSource]) -> list[Family]:
        if not isinstance(value, list) or not value:
            raise self.fail("candidates", "expected a non-empty list of families")
        out: list[Family] = []
        for i, entry in enumerate(value):
            key = f"candidates[{i}]"
            if not isinstance(entry, Mapping) or "family" not in entry:
                raise self.fail(key, f"expected a mapping with 'family' (one of {FAMILIES})")
            fam = entry["family"]
            if fam not in FAMILIES:
                raise self.fail(f"{key}.family", f"{fam!r} is not one of {', '.join(FAMILIES)}")
            out.append(self.family(key, self.mapping(key, entry, FAMILY_KEYS[fam]), models))
        seen: set[str] = set()
        for n in (n for f in out for n in (f.experts if f.family == "expert" else (f.name,))):
            if n in seen:
                raise self.fail(
                    "candidates", f"two rows are named {n!r}; give the families distinct `name`s"
                )
            seen.add(n)
        return out

    def family(self, key: str, entry: dict[str, Any], models: dict[str, ModelSource]) -> Family:
        fam = entry["family"]
        full = [n for n, m in models.items() if n != "base" and m.kind != "adapter"]
        adapters = [n for n, m in models.items() if m.kind == "adapter"]
        if fam == "base":
            return Family("base", entry.get("name", "base"))
        if fam == "composition" and "path" in entry:
            return self.saved_composition(key, entry)
        lora = fam.startswith("lora_")
        default = adapters if lora else (full + adapters if fam == "expert" else full)
        if "experts" not in entry and fam != "expert" and full and adapters:
            # Mixed experts: say which ones this family takes rather than drop some silently.
            kept, left = (adapters, full) if lora else (full, adapters)
            raise self.fail(
                f"{key}.experts",
                f"models.experts mixes full models {full} and LoRA adapters {adapters}: list "
                f"this {fam} family's experts — {kept} alone, or with {left} too"
                + (
                    " (an adapter listed in a composition or merge takes part as the base with "
                    "the adapter merged in)"
                    if not lora
                    else " (a lora_ family takes adapters only: list full models in a "
                    f"{fam.removeprefix('lora_')} family)"
                ),
            )
        experts = entry.get("experts", default)
        if not isinstance(experts, list) or not all(isinstance(e, str) for e in experts):
            raise self.fail(f"{key}.experts", f"expected a list of expert names, got {experts!r}")
        for e in experts:
            if e not in models or e == "base":
                raise self.fail(
                    f"{key}.experts",
                    f"{e!r} is not an expert of models.experts "
                    f"({', '.join(n for n in models if n != 'base')})",
                )
            if lora and models[e].kind != "adapter":
                raise self.fail(
                    f"{key}.experts", f"{fam} needs LoRA adapters; {e!r} is a full model"
                )
        if not experts:
            raise self.fail(
                f"{key}.experts", f"no {'adapter' if lora else 'model'} experts for {fam}"
            )
        if fam == "expert":
            best = entry.get("best_expert", True)
            if not isinstance(best, bool):
                raise self.fail(f"{key}.best_expert", f"expected true or false, got {best!r}")
            name = entry.get("name", "expert")
            if not isinstance(name, str) or not name:
                raise self.fail(f"{key}.name", f"expected a non-empty string, got {name!r}")
            return Family("expert", name, tuple(experts), best_expert=best)
        grid = self.grid(f"{key}.grid", entry.get("grid"))
        weights = entry.get("weights")
        if weights is not None:
            if not isinstance(weights, list) or len(weights) != len(experts):
                raise self.fail(
                    f"{key}.weights", f"expected {len(experts)} numbers (one per expert)"
                )
            weights = tuple(self.number(f"{key}.weights[{i}]", w) for i, w in enumerate(weights))
        method = entry.get("method")
        name = entry.get("name", method if fam in ("merge", "lora_merge") else fam)
        if not isinstance(name, str) or not name:
            raise self.fail(f"{key}.name", f"expected a non-empty string, got {name!r}")
        prefer = self.mapping(f"{key}.prefer", entry.get("prefer")) or None
        if prefer and set(prefer) - set(grid):
            raise self.fail(f"{key}.prefer", f"{sorted(set(prefer) - set(grid))} not in the grid")
        if fam in ("composition", "lora_composition"):
            return self.composition_family(
                key, fam, name, tuple(experts), grid, weights, entry, prefer
            )
        return self.merge_family(key, fam, name, tuple(experts), grid, weights, entry, prefer)

    def grid(self, key: str, value: Any) -> dict[str, tuple[Any, ...]]:
        grid = self.mapping(key, value)
        out = {}
        for k, values in grid.items():
            if not isinstance(values, list):
                values = [values]
            if not values:
                raise self.fail(f"{key}.{k}", "an empty list of values")
            for v in values:
                if not isinstance(v, (bool, int, float, str, list)) or (
                    isinstance(v, float) and not math.isfinite(v)
                ):
                    raise self.fail(f"{key}.{k}", f"{v!r} is not a finite number, string or bool")
            frozen = [tuple(v) if isinstance(v, list) else v for v in values]
            if len(set(frozen)) != len(frozen):
                raise self.fail(f"{key}.{k}", f"a value is listed twice: {values}")
            out[k] = tuple(values)
        return out

    def saved_composition(self, key: str, entry: dict[str, Any]) -> Family:
        """A composition saved by ``mergelab compose --save`` (or ``save_pretrained``): one
        row, its formula and models read from the folder."""
        from mergelab.compose.composed import CompositionConfig

        extra = sorted(set(entry) - {"family", "name", "path"})
        if extra:
            raise self.fail(
                f"{key}.{extra[0]}",
                "a saved composition fixes its formula and models: give only name and path",
            )
        path = self.path(f"{key}.path", entry["path"])
        try:
            saved = CompositionConfig.from_file(path)
        except (OSError, ValueError) as exc:
            raise self.fail(f"{key}.path", str(exc)) from exc
        name = entry.get("name", Path(path).name)
        if not isinstance(name, str) or not name:
            raise self.fail(f"{key}.name", f"expected a non-empty string, got {name!r}")
        return Family(
            "composition",
            name,
            tuple(n for n in saved.composition.components if n != "base"),
            eos_policy=saved.eos_policy,
            composition=saved.composition.to_dict(),
            path=path,
        )

    def composition_family(self, key, fam, name, experts, grid, weights, entry, prefer) -> Family:
        from mergelab.compose.eos import EOS_POLICIES
        from mergelab.compose.formula import Composition

        unknown = set(grid) - COMPOSITION_GRID_KEYS
        if unknown:
            raise self.fail(
                f"{key}.grid.{sorted(unknown)[0]}",
                f"a composition's grid takes {', '.join(sorted(COMPOSITION_GRID_KEYS))}",
            )
        if "weight" in grid and ("weights" in grid or weights is not None):
            raise self.fail(
                f"{key}.grid.weight",
                "give one weight for all experts (grid.weight) or per-expert weights, not both",
            )
        for i, v in enumerate(grid.get("weight", ())):
            self.number(f"{key}.grid.weight[{i}]", v)
        for i, v in enumerate(grid.get("weights", ())):
            if not isinstance(v, list) or len(v) != len(experts):
                raise self.fail(f"{key}.grid.weights[{i}]", f"expected {len(experts)} numbers")
            for j, w in enumerate(v):
                self.number(f"{key}.grid.weights[{i}][{j}]", w)
        eos = entry.get("eos_policy", "plain")
        for v in (*grid.get("eos_policy", ()), eos):
            if v not in EOS_POLICIES:
                raise self.fail(f"{key}.eos_policy", f"{v!r} is not one of {EOS_POLICIES}")
        formula = entry.get("composition")
        if formula is not None:
            if grid.keys() & {"weight", "weights"} or weights is not None or fam != "composition":
                raise self.fail(
                    f"{key}.composition",
                    "a formula fixes the weights: no weight grid, and not for lora_composition",
                )
            try:
                comp = Composition.from_dict(formula)
            except (ValueError, KeyError, TypeError) as exc:
                raise self.fail(f"{key}.composition", f"not a composition: {exc}") from exc
            missing = set(comp.components) - {"base", *experts}
            if missing:
                raise self.fail(
                    f"{key}.composition",
                    f"names models {sorted(missing)} that are not base or the family's experts",
                )
            formula = comp.to_dict()
        return Family(
            fam,
            name,
            experts,
            weights=weights,
            eos_policy=eos,
            composition=formula,
            grid=grid,
            prefer=prefer,
        )

    def merge_family(self, key, fam, name, experts, grid, weights, entry, prefer) -> Family:
        from mergelab.merge.registry import get_merge_method

        method = entry.get("method")
        if not isinstance(method, str):
            raise self.fail(f"{key}.method", "missing: name a registered merge method")
        try:
            impl = get_merge_method(method)
        except (KeyError, ValueError) as exc:
            raise self.fail(f"{key}.method", str(exc).strip("'\"")) from exc
        params = self.mapping(f"{key}.params", entry.get("params"))
        use_base = entry.get("use_base", True)
        if not isinstance(use_base, bool):
            raise self.fail(f"{key}.use_base", f"expected true or false, got {use_base!r}")
        if not use_base and impl.needs_base:
            raise self.fail(
                f"{key}.use_base",
                f"merge method {method!r} needs the base; `use_base: false` is for methods "
                "that merge the experts alone (e.g. linear, slerp)",
            )
        clash = set(params) & set(grid)
        if clash:
            raise self.fail(f"{key}.grid.{sorted(clash)[0]}", "also given in params")
        fam_obj = Family(
            fam,
            name,
            experts,
            method=method,
            params=params,
            weights=weights,
            grid=grid,
            prefer=prefer,
            use_base=use_base,
        )
        for point in fam_obj.points():  # every grid point is a valid call, before any tensor
            merged = {**params, **point}
            per_model = {"weight": list(weights)} if weights is not None else {}
            try:
                impl.resolve(len(experts), merged, per_model)
            except (ValueError, KeyError, TypeError) as exc:
                shown = ", ".join(f"{k}={v}" for k, v in point.items()) or "params"
                raise self.fail(f"{key}.grid ({shown})", str(exc)) from exc
        return fam_obj

    # -- benchmarks ----------------------------------------------------------------------------

    def benchmarks(self, value: Any, defaults: dict[str, dict[str, Any]]) -> list[BenchmarkSpec]:
        if not isinstance(value, list) or not value:
            raise self.fail("benchmarks", "expected a non-empty list")
        out: list[BenchmarkSpec] = []
        for i, entry in enumerate(value):
            key = f"benchmarks[{i}]"
            if not isinstance(entry, Mapping):
                raise self.fail(key, "expected a mapping")
            entry = self.mapping(key, entry, BENCHMARK_KEYS)
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise self.fail(f"{key}.name", "missing (every benchmark needs a name)")
            if name == "mean" or name in [b.name for b in out]:
                raise self.fail(f"{key}.name", f"{name!r} is reserved or used twice")
            out.append(self.benchmark(key, name, entry, defaults))
        names = [b.name for b in out]
        for b in out:
            if b.validation_from is not None:
                if b.validation_from not in names or b.validation_from == b.name:
                    raise self.fail(
                        f"benchmarks[{b.name}].validation_from",
                        f"{b.validation_from!r} is not another benchmark",
                    )
                if not self_bench(out, b.validation_from).has_validation:
                    raise self.fail(
                        f"benchmarks[{b.name}].validation_from",
                        f"{b.validation_from!r} has no validation split",
                    )
        return out

    def benchmark(self, key, name, entry, defaults) -> BenchmarkSpec:
        sources = [k for k in ("benchmark", "file", "lm_eval") if k in entry]
        if len(sources) != 1:
            raise self.fail(
                key,
                "give exactly one of `benchmark` (a mergelab benchmark name or a "
                "Benchmark object), `file` (your records) and `lm_eval` (an lm-eval task)",
            )
        if "lm_eval" in entry:
            from mergelab.eval.lm_eval_tasks import check_config

            config = self.mapping(f"{key}.lm_eval", entry["lm_eval"])
            if config.get("include_path") is not None:
                config["include_path"] = self.path(
                    f"{key}.lm_eval.include_path", config["include_path"]
                )
            try:
                load = {"lm_eval": check_config(config)}
            except ValueError as exc:
                raise self.fail(key, str(exc)) from None
            for k in ("task", "fields", "dataset_split", "path"):
                if k in entry:
                    raise self.fail(f"{key}.{k}", "not for `lm_eval` benchmarks")
        elif "file" in entry:
            from mergelab.eval.generic_tasks import GENERIC_TASKS, check_fields

            task = entry.get("task")
            known = list_tasks()
            if task not in known:
                raise self.fail(f"{key}.task", f"a benchmark file needs task: one of {known}")
            load = {"file": self.path(f"{key}.file", entry["file"]), "task": task}
            if task in GENERIC_TASKS:  # your own records, through field templates
                try:
                    load["fields"] = check_fields(
                        self.mapping(f"{key}.fields", entry.get("fields")), task
                    )
                except ValueError as exc:
                    raise self.fail(key, str(exc)) from None
                split = entry.get("dataset_split")
                if split is not None and not isinstance(split, str):
                    raise self.fail(f"{key}.dataset_split", f"expected a name, got {split!r}")
                load["dataset_split"] = split
                if not Path(load["file"]).exists():
                    raise self.fail(f"{key}.file", f"{load['file']} does not exist")
            else:
                for k in ("fields", "dataset_split"):
                    if k in entry:
                        raise self.fail(
                            f"{key}.{k}",
                            f"only for the generic tasks {', '.join(GENERIC_TASKS)}",
                        )
                if not Path(load["file"]).is_file():
                    raise self.fail(f"{key}.file", f"{load['file']} does not exist")
        else:
            bench = entry["benchmark"]
            if isinstance(bench, str):
                from mergelab.eval.tasks import (
                    benchmark_names,
                    canonical_benchmark_name,
                    needs_path,
                )

                try:
                    norm = canonical_benchmark_name(bench)
                except KeyError:
                    raise self.fail(
                        f"{key}.benchmark", f"{bench!r} is not one of {benchmark_names()}"
                    ) from None
                load = {"benchmark": norm}
                if "path" in entry:
                    load["path"] = self.path(f"{key}.path", entry["path"])
                elif needs_path(norm):
                    raise self.fail(f"{key}.path", f"benchmark {bench!r} needs a local file")
            elif hasattr(bench, "items") and hasattr(bench, "fingerprint"):
                load = {"object": bench}
            else:
                raise self.fail(
                    f"{key}.benchmark", f"expected a name or a Benchmark, got {bench!r}"
                )
            for k in ("task", "fields", "dataset_split"):
                if k in entry:
                    raise self.fail(f"{key}.{k}", "only for `file` benchmarks")
        split = self.mapping(f"{key}.split", entry.get("split"), SPLIT_KEYS)
        val, test = split.get("validation"), split.get("test", "rest")
        for part, v in (("validation", val), ("test", test)):
            ok = (
                v is None
                or v == "rest"
                or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
            )
            ok = ok or (isinstance(v, list) and v and all(isinstance(x, (str, int)) for x in v))
            if not ok:
                raise self.fail(
                    f"{key}.split.{part}",
                    f"expected a list of item ids, a count ≥ 1, or 'rest', got {v!r}",
                )
        if val == "rest" and test == "rest":
            raise self.fail(f"{key}.split", "validation and test cannot both be 'rest'")
        if val is None and test == "rest":
            test = "all"
        if isinstance(val, list) and isinstance(test, list):
            overlap = sorted(set(map(str, val)) & set(map(str, test)))
            if overlap:
                raise self.fail(
                    f"{key}.split",
                    f"validation and test share {len(overlap)} item(s): {overlap[:5]}",
                )
        vfrom = entry.get("validation_from")
        if vfrom is not None and val is not None:
            raise self.fail(f"{key}.validation_from", "the benchmark has its own validation split")
        split_seed = split.get("seed")
        if split_seed is not None:
            split_seed = self.integer(f"{key}.split.seed", split_seed, minimum=0)
        gen = {
            **defaults["generation"],
            **self.mapping(f"{key}.generation", entry.get("generation")),
        }
        prompt = {**defaults["prompt"], **self.mapping(f"{key}.prompt", entry.get("prompt"))}
        ev = {**defaults["eval"], **self.mapping(f"{key}.eval", entry.get("eval"), EVAL_KEYS)}
        self.eval_settings(key, gen, prompt, ev)
        baselines = entry.get("baselines")
        if baselines is not None and not (
            (isinstance(baselines, list) and all(isinstance(b, str) for b in baselines))
            or (isinstance(baselines, Mapping) and all(callable(f) for f in baselines.values()))
        ):
            raise self.fail(
                f"{key}.baselines",
                "expected a list of baseline names the task "
                "declares, or (from Python) a mapping of names to functions",
            )
        return BenchmarkSpec(
            name=name,
            load=load,
            split_validation=val,
            split_test=test,
            split_seed=split_seed,
            validation_from=vfrom,
            generation=gen,
            prompt=prompt,
            eval=ev,
            baselines=dict(baselines) if isinstance(baselines, Mapping) else baselines,
        )

    def eval_settings(self, key: str, gen: dict, prompt: dict, ev: dict) -> None:
        """Build the settings once so a bad field is an error now, naming the benchmark."""
        try:
            eval_settings_for(gen, prompt, ev, seed=0, bootstrap_samples=100, confidence=0.95)
        except (TypeError, ValueError) as exc:
            raise self.fail(f"{key}.generation/prompt/eval", str(exc)) from exc


def self_bench(benchmarks: Sequence[BenchmarkSpec], name: str) -> BenchmarkSpec:
    return next(b for b in benchmarks if b.name == name)


def eval_settings_for(
    gen: Mapping[str, Any],
    prompt: Mapping[str, Any],
    ev: Mapping[str, Any],
    *,
    seed: int,
    bootstrap_samples: int,
    confidence: float,
):
    """The :class:`~mergelab.eval.EvalSettings` of one benchmark for one seed: sampling draws
    from ``seed`` unless the spec fixes ``generation.seed``."""
    from mergelab.candidate import GenerationSettings
    from mergelab.eval.harness import EvalSettings
    from mergelab.eval.prompts import PromptConfig

    gen = dict(gen)
    if "stop_strings" in gen:
        gen["stop_strings"] = tuple(gen["stop_strings"])
    if gen.get("do_sample") and gen.get("seed") is None:
        gen["seed"] = seed
    prompt = dict(prompt)
    for k in ("stop_strings", "exemplars"):
        if prompt.get(k) is not None:
            prompt[k] = tuple(prompt[k])
    ev = dict(ev)
    for k in ("pass_k", "packages"):
        if isinstance(ev.get(k), list):
            ev[k] = tuple(ev[k])
    gen_settings = GenerationSettings(**gen)
    return EvalSettings(
        generation=gen_settings,
        prompt=PromptConfig(**prompt),
        bootstrap_samples=bootstrap_samples,
        confidence=confidence,
        seed=seed,
        **ev,
    )


def _describe(obj: Any) -> Any:
    """The spec as JSON: objects (models, tokenizers, benchmarks, functions) by description."""
    if isinstance(obj, Mapping):
        return {str(k): _describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_describe(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "state_dict") and hasattr(obj, "forward"):
        from mergelab.compose.vocab import model_identity

        return {"in_memory_model": model_identity(obj)}
    if hasattr(obj, "fingerprint") and hasattr(obj, "describe"):
        return {"in_memory_benchmark": obj.describe()}
    if isinstance(obj, Callable):
        return {"function": getattr(obj, "__qualname__", repr(obj))}
    if hasattr(obj, "get_vocab"):
        from mergelab.compose.vocab import tokenizer_fingerprint

        return {"in_memory_tokenizer": tokenizer_fingerprint(obj)}
    return repr(obj)
