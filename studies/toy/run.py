"""Toy study recipe: letter replacement, span skills, length generalisation, failure cases.

Logit composition (docs/composition.md) next to the weight merges the paper did not run, on tiny
GPT-2 models trained here on CPU. Every row — base, expert, composition, each merge — is a
``mergelab.candidate.Candidate`` evaluated by the same calls: generative rows by
``mergelab.compare.run`` (a Python spec of in-memory models), aligned rows by the study's own
single-forward evaluator (:mod:`.evaluate` says why). Each seed runs every part:

1. authors + failure  (:func:`.parts.part_authors_and_failures`) aligned, all from scratch:
   A→B + C→D and A→K + M→B; a conflict (A→B + A→C), a chain (A→B + B→C), a wrong base.
2. shared             (:func:`.parts.part_shared`) experts fine-tuned (full, LoRA) from the
   base, so that every weight merge is a row next to the composition.
3. generative         (:func:`.parts.part_generative`) ``x [SEP] y [EOS]``, greedy until EOS;
   every merge of the grid is a row, and task arithmetic with λ chosen by compare on 100
   validation strings (highest joint exact match, smallest λ on ties).
4. length             (:func:`.parts.part_length`) trained at 16, tested at 1..64.
5. spans              (:func:`.spans.part_spans`) skills inside <…> and (…), overlap 0..4.
6. diagnostics        (:func:`.spans.part_diagnostics`) per-token activity and co-activity.

    python studies/toy_letters.py              # = python -m studies.toy.run; fast setting,
                                               #   3 seeds, ~22 min per seed on 1 thread
    python studies/toy_letters.py --full       # batch size 1 as the authors, 5 seeds, lengths 1..64
    python studies/toy_letters.py --plot-only  # redraw figures from results/toy/<setting>/
    python studies/toy_letters.py --parts generative length-generative
                                               # recompute those parts' records in the seed files

Other recipes of the study: ``python -m studies.toy.authors_exact`` (the authors' notebook,
setting by setting), ``python -m studies.toy.explanations`` (tests of the explanations),
``python -m studies.toy.many_experts`` (three and four experts).

Outputs: results/toy/<fast|full>/{config.json, seed_<s>.json, summary.csv, summary.json};
figures/toy_*.png (fast) or figures/toy_full_*.png, drawn by :mod:`.figures` from summary.json.
A seed file holds the records, compare's ``choices`` on validation (per part) and, after
``--parts``, what was rerun (``reran``: the units, and that run's seconds and timings, in which
the other parts only drew their training data). A finished seed whose settings match is reused;
``--force`` recomputes it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mergelab.errors import UserInputError  # noqa: E402
from mergelab.results import json_with_keys, write_json_atomic  # noqa: E402
from mergelab.toy import random_strings  # noqa: E402

from . import figures  # noqa: E402
from .parts import part_authors_and_failures, part_generative, part_length, part_shared  # noqa: E402
from .spans import part_diagnostics, part_spans  # noqa: E402
from .study import UNITS, Settings, Study, full_settings, merge_grid, unit_of  # noqa: E402
from .summary import print_main_table, summarise, write_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_seed(settings: Settings, seed: int, units: set[str] | None = None) -> dict:
    """Every part for one seed (or only ``units``); the order of the calls fixes every model's
    data and seed, so a part skipped still draws its training data (not training) for the next."""
    torch.manual_seed(seed)
    st = Study(settings, seed, units)
    test = random_strings(settings.n_test, settings.train_length, random.Random(10_000 + seed))
    st.train = st.needs("scratch")
    scratch = part_authors_and_failures(st, test)
    st.train = st.needs("shared")
    shared = part_shared(st, scratch["base"], test)
    st.train = st.needs("generative")
    generative = part_generative(st, test)
    st.train = True
    part_length(st, scratch, shared, generative)
    if st.needs("spans"):  # the last trained part: skipped outright when nothing needs it
        spans = part_spans(st)
        if st.wants("diagnostics"):
            part_diagnostics(st, scratch, shared, generative, spans, test)
    return {"seed": seed, "timings": st.timings, "records": st.records, "choices": st.choices}


def record_key(r: dict) -> tuple:
    return (r["part"], r["pair"], r["method"], r["metric"], r["x"])


def merge_records(old: list[dict], new: list[dict], units: set[str]) -> list[dict]:
    """``old`` with the records of ``units`` replaced by ``new``'s, in ``old``'s order; a record
    ``old`` lacks goes right after the record ``new`` wrote before it."""
    position = {}
    for i, r in enumerate(old):
        if unit_of(r) in units:
            if record_key(r) in position:
                raise ValueError(f"two records {record_key(r)} in one seed")
            position[record_key(r)] = i
    replaced: dict[int, dict] = {}
    after: dict[int, list[dict]] = defaultdict(list)
    last = -1
    for r in new:
        i = position.get(record_key(r))
        if i is None:
            after[last].append(r)
        else:
            last = i
            replaced[i] = r
    out = list(after[-1])
    for i, r in enumerate(old):
        if unit_of(r) not in units:
            out.append(r)
        elif i in replaced:
            out.append(replaced[i])
        out += after[i]
    return out


def reusable(path: Path, settings: Settings) -> bool:
    """A finished seed is reused if it ran with the same settings (the list of seeds aside)."""
    try:
        saved = json.loads(path.read_text())["settings"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return False
    return {**saved, "seeds": None} == {**settings.to_dict(), "seeds": None}


def previous_run(path: Path, settings: Settings) -> dict:
    """A finished seed that ``--parts`` can update: run with the same settings, except settings
    added since (absent from the file; the update records the current ones)."""
    try:
        saved = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise UserInputError(f"--parts updates a finished seed; cannot read {path}: {exc}") from exc
    now = settings.to_dict() | {"seeds": None}
    if now | saved.get("settings", {}) | {"seeds": None} != now:
        raise UserInputError(f"--parts: {path} was run with other settings; rerun it whole")
    return saved


def run_seeds(
    settings: Settings, out_dir: Path, threads: int, force: bool, units: set[str] | None = None
) -> None:
    """Run (or reuse) each seed's records, then write the summary. With ``units``, only their
    records are recomputed and replace those of the seed's finished file."""
    torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    merges = [g[:3] for g in merge_grid(settings.lambdas)]
    config = {"settings": settings.to_dict(), "merges": merges, "torch": torch.__version__}
    write_json_atomic(
        out_dir / "config.json",
        config | {"threads": threads},
        indent=1,
        written_by_mergelab=json_with_keys("settings", "merges"),
    )
    for seed in tqdm(settings.seeds, desc=f"toy ({settings.name}) seeds"):
        path = out_dir / f"seed_{seed}.json"
        if units is None and not force and reusable(path, settings):
            tqdm.write(f"seed {seed}: reusing {path}")
            continue
        old = previous_run(path, settings) if units is not None else None
        t0 = time.perf_counter()
        result = run_seed(settings, seed, units)
        seconds = round(time.perf_counter() - t0, 1)
        if old is None:
            result |= {"settings": settings.to_dict(), "seconds": seconds}
        else:  # the first run's timings stay; the update's are listed under "reran"
            rerun = {"units": sorted(units), "seconds": seconds, "timings": result["timings"]}
            result = old | {
                "records": merge_records(old["records"], result["records"], units),
                "choices": old.get("choices", {}) | result["choices"],
                "settings": settings.to_dict(),
                "reran": old.get("reran", []) + [rerun],
            }
        write_json_atomic(path, result, written_by_mergelab=json_with_keys("seed", "records"))
        tqdm.write(f"seed {seed}: {seconds} s  {result['timings']}")
    runs = [json.loads((out_dir / f"seed_{s}.json").read_text()) for s in settings.seeds]
    write_summary(out_dir, summarise(runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--full", action="store_true", help="batch size 1, 5 seeds, lengths 1..64")
    p.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    p.add_argument("--plot-only", action="store_true", help="redraw figures from the summary file")
    p.add_argument("--force", action="store_true", help="recompute seeds that already have results")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "toy")
    p.add_argument("--figures", type=Path, default=ROOT / "figures")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models: 1)")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=list(UNITS),
        help="recompute only these parts' records in the finished seed files (the models they "
        "need are retrained; earlier parts' training data are drawn, not trained on)",
    )
    args = p.parse_args(argv)

    settings = full_settings() if args.full else Settings()
    if args.seeds:
        settings.seeds = args.seeds
    out_dir = args.results / settings.name
    if not args.plot_only:
        try:
            units = set(args.parts) if args.parts else None
            run_seeds(settings, out_dir, args.threads, args.force, units)
        except UserInputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    summary_path = out_dir / "summary.json"
    if not summary_path.exists():
        print(f"no results at {summary_path}; run without --plot-only first", file=sys.stderr)
        return 2
    rows = json.loads(summary_path.read_text())
    print_main_table(rows)
    prefix = args.figures / ("toy_" if settings.name == "fast" else f"toy_{settings.name}_")
    for path in figures.draw_all(rows, prefix, settings.name):
        print(f"figure: {path}")
    if settings.name == "fast":  # the other recipes' figures, from their results files
        for path in figures.draw_results(args.results, args.figures / "toy_"):
            print(f"figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
