"""Settings of the toy study and the :class:`Study` that trains models and records results.

One ``Study`` per seed: it owns the seed's data stream and model seeds (so the order of calls
fixes every model), the tokenizers, and the list of result records every part appends to.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder
from mergelab.merge import list_merge_methods, merge_models
from mergelab.toy import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    build_char_tokenizer,
    parallel_target,
    random_strings,
)
from mergelab.toy.tasks import SPAN_MARKERS

from .evaluate import (
    aligned_predictions,
    compare_letters,
    exact_match,
    letter_benchmarks,
    row_scores,
    skill_success,
    stop_outcomes,
)
from .train import TrainConfig, finetune_full, finetune_lora, tiny_gpt2, train_model


@dataclass
class Settings:
    """The study's settings. Every model here differs from the authors' notebook in dropout (0,
    not 0.1), weight decay (0, not 0.01), position table (160, not 32), vocabulary (30: pad, EOS
    and separator added) and data order (reshuffled each epoch); ``authors_exact.py`` has theirs."""

    name: str = "fast"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    n_train: int = 2000  # examples per model (authors: 2000)
    train_length: int = 16  # authors: 16
    n_test: int = 300  # test strings per seed at the trained length
    n_test_per_length: int = 60  # per length in the length sweep
    lengths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64])
    # Authors: AdamW lr 3e-4, batch 1, 5 epochs. Fast: batch 16 (same lr, epochs).
    scratch: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=5, batch_size=16))
    # Generative models from scratch: copying across the separator needs more updates than
    # the aligned map; lr 1e-3 reaches 100% at length 16 in 5 epochs of batch 16. Trained at
    # exactly length 16 (lengths 1..16 mixed reached only 66% teacher-forced in 15 epochs).
    generative: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=5, batch_size=16, lr=1e-3)
    )
    generative_finetune: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=2, batch_size=16, lr=1e-3)
    )
    finetune: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=2, batch_size=16))
    lora: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=3, batch_size=16, lr=3e-3))
    lora_rank: int = 4
    spans_base: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=6, batch_size=16, lr=1e-3)
    )
    spans_finetune: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=4, batch_size=16, lr=1e-3)
    )
    span_letters: int = 12
    span_width: int = 4  # letters per span in the overlap sweep (overlap 0..span_width)
    n_span_test: int = 150  # per overlap value
    lambdas: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    # Validation strings (length train_length) on which compare chooses the generative TA's λ.
    n_validation: int = 100

    def to_dict(self) -> dict:
        return asdict(self)


def full_settings() -> Settings:
    """The authors' batch size 1 for the aligned models, 5 seeds, every length 1..64."""
    authors = TrainConfig(epochs=5, batch_size=1, lr=3e-4)
    return Settings(
        name="full",
        seeds=[0, 1, 2, 3, 4],
        n_test=1000,
        n_test_per_length=200,
        lengths=list(range(1, 65)),
        scratch=authors,
        generative=TrainConfig(epochs=5, batch_size=4, lr=1e-3),
        generative_finetune=TrainConfig(epochs=2, batch_size=4, lr=1e-3),
        finetune=TrainConfig(epochs=2, batch_size=1, lr=3e-4),
        lora=TrainConfig(epochs=3, batch_size=4, lr=3e-3),
        n_span_test=500,
    )


# The weight merges compared with the composition (all on experts fine-tuned from one base).
# (label, method, params, use_base); "linear" and "slerp" interpolate the two experts.
def merge_grid(lambdas: list[float]) -> list[tuple[str, str, dict, bool]]:
    grid = [(f"TA λ={lam:g}", "task_arithmetic", {"lambda_": lam}, True) for lam in lambdas]
    grid += [
        ("TIES d=0.2", "ties", {"density": 0.2, "lambda_": 1.0}, True),
        ("TIES d=0.5", "ties", {"density": 0.5, "lambda_": 1.0}, True),
        ("DARE-lin d=0.5", "dare_linear", {"density": 0.5, "lambda_": 1.0}, True),
        ("DARE-TIES d=0.5", "dare_ties", {"density": 0.5, "lambda_": 1.0}, True),
        ("linear avg", "linear", {}, False),
        ("SLERP t=0.5", "slerp", {"t": 0.5}, False),
    ]
    have = set(list_merge_methods())
    return [g for g in grid if g[1] in have]


# What a run can be limited to (``--parts``), in run order: the record parts each unit writes,
# and the trained models it needs (the units' training stages: scratch, shared, generative,
# spans). Diagnostics records carry the part they diagnose and kind "diagnostic".
UNITS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "authors": (("authors", "failure"), frozenset({"scratch"})),
    "shared": (
        ("shared-full", "shared-lora", "failure-shared-full"),
        frozenset({"scratch", "shared"}),
    ),
    "generative": (("generative", "generative-shared"), frozenset({"generative"})),
    "length-authors": (("length-authors",), frozenset({"scratch"})),
    "length-shared-full": (("length-shared-full",), frozenset({"scratch", "shared"})),
    "length-generative": (("length-generative",), frozenset({"generative"})),
    "spans": (("spans",), frozenset({"spans"})),
    "diagnostics": ((), frozenset({"scratch", "shared", "generative", "spans"})),
}


def unit_of(record: dict) -> str:
    """The unit (of :data:`UNITS`) that wrote a result record."""
    if record["kind"] == "diagnostic":
        return "diagnostics"
    return next(u for u, (parts, _) in UNITS.items() if record["part"] in parts)


class Study:
    """Holds the tokenizers and settings of one run and collects result records.

    ``units``: the :data:`UNITS` to evaluate (None: all); the others are not evaluated. While
    ``train`` is False, :meth:`scratch` and :meth:`finetuned` draw their data and seeds as training
    would, so the models of later parts are the same, and return the model untrained.
    """

    def __init__(self, settings: Settings, seed: int, units: set[str] | None = None):
        self.s = settings
        self.seed = seed
        self.units = units
        self.train = True
        self.choices: dict[str, dict] = {}  # per record part: compare's choices on validation
        self.rng = random.Random(seed)
        self.tok = build_char_tokenizer()
        self.span_tok = build_char_tokenizer(SPAN_MARKERS)
        self.aligned = AlignedTask(self.tok)
        self.generative = GenerativeTask(self.tok)
        self.records: list[dict] = []
        self.timings: dict[str, float] = {}
        self._model_seed = seed * 1000

    # ---- training ----------------------------------------------------------------------
    def next_seed(self) -> int:
        self._model_seed += 1
        return self._model_seed

    def train_data(self, task, fn, length) -> tuple[torch.Tensor, torch.Tensor]:
        xs = random_strings(self.s.n_train, length, self.rng)
        return task.encode(xs, [fn(x) for x in xs])

    def wants(self, part: str) -> bool:
        """Whether this run evaluates the record part ``part`` (``diagnostics``: that unit)."""
        return self.units is None or any(part == u or part in UNITS[u][0] for u in self.units)

    def needs(self, stage: str) -> bool:
        """Whether a unit of this run needs the models of training stage ``stage``."""
        return self.units is None or any(stage in UNITS[u][1] for u in self.units)

    def scratch(self, letter_map: LetterMap, *, generative: bool = False):
        """A model trained from scratch to perform ``letter_map`` (identity = the base)."""
        task = self.generative if generative else self.aligned
        cfg = replace(self.s.generative if generative else self.s.scratch, seed=self.next_seed())
        model = tiny_gpt2(len(self.tok), seed=cfg.seed)
        data = self.train_data(task, letter_map, self.s.train_length)
        if self.train:
            train_model(model, *data, cfg)
        return model

    def finetuned(self, base, letter_map: LetterMap, *, lora: bool = False, generative=False):
        """A fine-tune of ``base`` (full, or LoRA merged back into a full model)."""
        data = self.train_data(
            self.generative if generative else self.aligned, letter_map, self.s.train_length
        )
        config = (
            self.s.lora if lora else self.s.generative_finetune if generative else self.s.finetune
        )
        cfg = replace(config, seed=self.next_seed())
        if not self.train:
            return copy.deepcopy(base)
        if lora:
            return finetune_lora(base, *data, cfg, rank=self.s.lora_rank)
        return finetune_full(base, *data, cfg)

    # ---- candidates --------------------------------------------------------------------
    def single(self, model, name, tok=None):
        return ModelCandidate(model, tok or self.tok, name=name)

    def composed(self, base, experts, names, tok=None, name="composition"):
        return ComposedDecoder(base, experts, tok or self.tok, expert_names=list(names), name=name)

    def merges(self, base, experts) -> dict[str, torch.nn.Module]:
        """Every merge of the grid, by label; none while ``train`` is False (the experts are
        then untrained copies of the base)."""
        out = {}
        if not self.train:
            return out
        for label, method, params, use_base in merge_grid(self.s.lambdas):
            out[label] = merge_models(
                method, base if use_base else None, experts, params=params, seed=self.seed
            )
        return out

    # ---- recording ---------------------------------------------------------------------
    def record(self, part, pair, method, kind, metric, values, x=None):
        self.records.append(
            {
                "part": part,
                "pair": pair,
                "method": method,
                "kind": kind,
                "seed": self.seed,
                "x": x,
                "metric": metric,
                "values": [float(v) for v in np.asarray(values).tolist()],
            }
        )

    def compare_letters(
        self, part, maps, models, candidates, rows, inputs, *, validation=(), x=None
    ):
        """Generative rows through :func:`mergelab.compare.run`, recorded as :meth:`eval_letters`
        records them: joint exact match, and (at the trained length, ``x`` None) each skill's
        success. ``models``: ``base`` and experts by name; ``candidates``: compare's families;
        ``rows``: ``(kind, method, compare row)`` in the order they are recorded. Returns compare's
        choices for this seed (grid points chosen on the ``validation`` strings)."""
        if not self.wants(part):
            return {}
        benchmarks = letter_benchmarks(maps, inputs, validation)
        results = compare_letters(models, self.tok, candidates, benchmarks, self.seed)
        pair = " + ".join(m.name for m in maps)
        for kind, method, row in rows:
            self.record(part, pair, method, kind, "joint", row_scores(results, row, "joint"), x)
            if x is not None:  # the length sweep: where each generation stopped
                for metric, values in stop_outcomes(results, row, "joint", x).items():
                    self.record(part, pair, method, kind, metric, values, x)
                continue
            for m in maps:  # a skill that touches no input has no benchmark: no examples
                name = f"skill {m.name}"
                values = row_scores(results, row, name) if name in results["benchmarks"] else []
                self.record(part, pair, method, kind, name, values)
        return results["choices"][str(self.seed)]

    def eval_letters(self, part, maps, candidates, inputs, *, x=None):
        """Aligned rows: joint exact match (parallel and chain targets) and per-skill success."""
        if not self.wants(part):
            return
        pair = " + ".join(m.name for m in maps)
        parallel = [parallel_target(maps, s) for s in inputs]
        chained = [LetterMap.chain(maps, s) for s in inputs]
        for kind, cand in candidates:
            preds = aligned_predictions(cand, self.aligned, inputs)
            self.record(part, pair, cand.name, kind, "joint", exact_match(preds, parallel), x)
            if parallel != chained and None not in parallel:  # a true chain (A->B, B->C)
                self.record(part, pair, cand.name, kind, "chain", exact_match(preds, chained), x)
            if x is not None:
                continue
            for m in maps:
                self.record(
                    part, pair, cand.name, kind, f"skill {m.name}", skill_success(inputs, preds, m)
                )
            # What happens on letters two experts both rewrite (conflict case only).
            for letter in {a for a, _ in maps[0].pairs} & {a for m in maps[1:] for a, _ in m.pairs}:
                outs = [
                    p[i]
                    for s, p in zip(inputs, preds)
                    for i, c in enumerate(s)
                    if c == letter and len(p) == len(s)
                ]
                for m in maps:
                    self.record(
                        part,
                        pair,
                        cand.name,
                        kind,
                        f"{letter} written as {m(letter)}",
                        [o == m(letter) for o in outs],
                    )
                self.record(
                    part, pair, cand.name, kind, f"{letter} kept", [o == letter for o in outs]
                )

    def tick(self, label, t0):
        self.timings[label] = round(time.perf_counter() - t0, 2)
