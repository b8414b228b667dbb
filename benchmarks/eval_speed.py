"""Does mergelab evaluate as fast as lm-evaluation-harness? The same model, tasks and batch size.

One model — a Llama built from a config (``--hidden-size``, ``--layers``) with a character
tokenizer, saved to a temporary folder — on two tasks, both defined from lm-eval's own task files
with a local jsonl (``include`` of lm-eval's YAML, ``dataset_path: json``; the data are generated
here, so nothing is downloaded):

* ``gen`` — lm-eval's ``gsm8k`` (generate-until, greedy), zero-shot, with mergelab's GSM8K prompt
  and stop strings (``Q: …\\nA:``, stop at ``Q:``, ``</s>``, ``<|im_end|>``, three newlines) so
  that every path decodes the same text, ``--max-new-tokens`` per item;
* ``ll`` — lm-eval's ``arc_easy`` (log-likelihood of 4 choices per item).

Paths, timed round-robin (best of ``--repeats``) so that drifting load hits them alike, all at
batch ``--batch-size``:

    hf                 lm-eval's ``hf`` model (HFLM on the saved folder): the reference, ratio 1
    mergelab_lm_eval   lm-eval with ``--model mergelab`` (MergelabLM on a ModelCandidate)
    mergelab_eval      gen only: ``mergelab.eval.evaluate`` (what ``mergelab eval run`` and
                       compare's jobs call) on the same items, prompts and stop strings
    compose_lm_eval    MergelabLM on a composition of the base and two experts (k = 3 models)
    compose_eval       gen only: ``evaluate`` on that composition

lm-eval's tasks are built before each timed run (not timed: lm-eval reads its YAML and the
dataset); the timed part is ``lm_eval.evaluator.evaluate`` (requests, model, metrics) or
``evaluate`` (prompts, generation, scoring, a fresh generation cache each time). Reported: seconds
per item, tokens per second (gen: generated tokens; ll: context + continuation tokens of every
request) and the ratio to ``hf``, on the wall clock and in CPU seconds of this process
(``time.process_time``: on one thread, the work itself, which a shared machine's wall clock
hides). Greedy texts and log-likelihoods are checked to be equal between
hf and mergelab for the single model. Targets: mergelab ≤ 1.0× hf per item for one model; a
composition of k models ≤ (k + 1)× hf.

    python benchmarks/eval_speed.py                      # writes benchmarks/results/eval_speed.json
    python benchmarks/eval_speed.py --items 4 --repeats 1 --max-new-tokens 8 --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;=+-*/()?!#$\n"
GEN_STOPS = ["Q:", "</s>", "<|im_end|>", "\n\n\n"]  # mergelab's GSM8K stops (prompts.GSM8K_STOPS)


# ---------------------------------------------------------------------------- setting


def build_model(folder: Path, hidden: int, layers: int, seed: int = 0):
    """A Llama from a config and a character tokenizer, saved to ``folder`` (what HFLM loads)."""
    from mergelab.tiny import char_tokenizer, tiny_llama

    tok = char_tokenizer(ALPHABET, unk="<unk>", padding_side="left")
    model = tiny_llama(
        len(tok),
        seed=seed,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        max_positions=1024,
        bos_token_id=tok.bos_token_id,
        initializer_range=0.3,  # peaked next-token distributions: no near-ties in greedy decoding
    )
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok


def perturbed(model, noise: float, seed: int):
    """An "expert": every tensor moved by ``noise`` × its own std, at random."""
    expert = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in expert.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return expert.eval()


def write_tasks(folder: Path, items: int, max_new_tokens: int, seed: int = 0) -> dict[str, Path]:
    """jsonl data and lm-eval YAMLs (``include`` of lm-eval's gsm8k and arc_easy) in ``folder``."""
    import lm_eval

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    rng = random.Random(seed)
    gen, ll = [], []
    for i in range(items):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
        gen.append({"question": question, "answer": f"{a} + {b} = {a + b}.\n#### {a + b}"})
        choices = [str(a + b + d) for d in rng.sample([-2, -1, 0, 1, 2, 3], 4)]
        if str(a + b) not in choices:
            choices[rng.randrange(4)] = str(a + b)
        ll.append(
            {
                "id": f"q{i}",
                "question": f"What is {a} plus {b}?",
                "choices": {"text": choices, "label": list("ABCD")},
                "answerKey": "ABCD"[choices.index(str(a + b))],
            }
        )
    paths = {"gen": folder / "gen.jsonl", "ll": folder / "ll.jsonl"}
    for name, rows in (("gen", gen), ("ll", ll)):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    until = json.dumps(GEN_STOPS)
    (folder / "speed_gen.yaml").write_text(
        f"include: {tasks_dir / 'gsm8k' / 'gsm8k.yaml'}\n"
        "task: speed_gen\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {paths['gen']}\n"
        "training_split: null\nfewshot_split: null\ntest_split: test\nnum_fewshot: 0\n"
        'doc_to_text: "Q: {{question}}\\nA:"\n'
        f"generation_kwargs:\n  until: {until}\n  do_sample: false\n  temperature: 0.0\n"
        f"  max_gen_toks: {max_new_tokens}\n"
    )
    (folder / "speed_ll.yaml").write_text(
        f"include: {tasks_dir / 'arc' / 'arc_easy.yaml'}\n"
        "task: speed_ll\n"
        "tag: []\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {paths['ll']}\n"
        "training_split: null\nvalidation_split: null\ntest_split: test\n"
    )
    return paths


# ---------------------------------------------------------------------------- paths


def lm_eval_run(lm, task: str, manager) -> tuple[float, list]:
    """((wall, CPU) seconds of ``lm_eval.evaluator.evaluate``, the task's samples) for ``lm``;
    ``manager``: lm-eval's ``TaskManager`` with the local tasks' folder on its include path."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import get_task_dict

    task_dict = get_task_dict([task], manager)
    start, start_cpu = time.perf_counter(), time.process_time()
    out = evaluate(lm, task_dict, log_samples=True, verbosity="ERROR")
    seconds = (time.perf_counter() - start, time.process_time() - start_cpu)
    return seconds, out["samples"][task]


def mergelab_eval_run(candidate, bench, max_new_tokens: int, batch: int, cache: Path):
    """((wall, CPU) seconds of ``mergelab.eval.evaluate`` with a fresh generation cache, its
    records by item id)."""
    from mergelab.candidate import GenerationSettings
    from mergelab.eval import EvalSettings, evaluate
    from mergelab.eval.prompts import PromptConfig

    settings = EvalSettings(
        generation=GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch),
        prompt=PromptConfig(n_shots=0),
        bootstrap_samples=100,
    )
    run_cache = Path(tempfile.mkdtemp(dir=cache))
    start, start_cpu = time.perf_counter(), time.process_time()
    result = evaluate(candidate, bench, settings, cache_dir=run_cache, progress=False)
    seconds = (time.perf_counter() - start, time.process_time() - start_cpu)
    records = [
        json.loads(line) for line in (result.run_dir / "generations.jsonl").read_text().splitlines()
    ]
    return seconds, {r["item_id"]: r for r in records}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=32, help="items per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.02, help="the experts' perturbation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/eval_speed.json")
    args = parser.parse_args(argv)
    for name in ("items", "batch_size", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    import transformers
    from lm_eval.models.huggingface import HFLM

    from mergelab.compose import ComposedDecoder
    from mergelab.eval.benchmarks import load_gsm8k
    from mergelab.eval.lm_eval_bridge import MergelabLM
    from mergelab.model_candidate import ModelCandidate

    transformers.logging.set_verbosity_error()
    load_before, started = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base, tok = build_model(work / "model", args.hidden_size, args.layers)
        data = write_tasks(work, args.items, args.max_new_tokens)
        bench = load_gsm8k(data["gen"])
        hf = HFLM(pretrained=str(work / "model"), batch_size=args.batch_size, device="cpu")
        hf_model = hf.model
        single = ModelCandidate(base, tok, name="model")
        experts = [perturbed(base, args.noise, seed) for seed in (1, 2)]
        composed = ComposedDecoder(base, experts, tok)
        lms = {
            "mergelab_lm_eval": MergelabLM(single, batch_size=args.batch_size),
            "compose_lm_eval": MergelabLM(composed, batch_size=args.batch_size),
        }
        cache = work / "cache"
        cache.mkdir()
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(work), include_defaults=False, verbosity="ERROR")
        plan = {
            "gen": {
                "hf": lambda: lm_eval_run(hf, "speed_gen", manager),
                "mergelab_lm_eval": lambda: lm_eval_run(
                    lms["mergelab_lm_eval"], "speed_gen", manager
                ),
                "mergelab_eval": lambda: mergelab_eval_run(
                    single, bench, args.max_new_tokens, args.batch_size, cache
                ),
                "compose_lm_eval": lambda: lm_eval_run(
                    lms["compose_lm_eval"], "speed_gen", manager
                ),
                "compose_eval": lambda: mergelab_eval_run(
                    composed, bench, args.max_new_tokens, args.batch_size, cache
                ),
            },
            "ll": {
                "hf": lambda: lm_eval_run(hf, "speed_ll", manager),
                "mergelab_lm_eval": lambda: lm_eval_run(
                    lms["mergelab_lm_eval"], "speed_ll", manager
                ),
                "compose_lm_eval": lambda: lm_eval_run(lms["compose_lm_eval"], "speed_ll", manager),
            },
        }
        best: dict[str, dict[str, float]] = {t: {} for t in plan}
        best_cpu: dict[str, dict[str, float]] = {t: {} for t in plan}
        outputs: dict[str, dict[str, object]] = {t: {} for t in plan}
        for task, paths in plan.items():  # warm-up: one run of each path, not timed
            for path, fn in paths.items():
                outputs[task][path] = fn()[1]
        for repeat in range(args.repeats):
            for task, paths in plan.items():
                for path, fn in paths.items():
                    (seconds, cpu), _ = fn()
                    best[task][path] = min(best[task].get(path, float("inf")), seconds)
                    best_cpu[task][path] = min(best_cpu[task].get(path, float("inf")), cpu)
                    print(
                        f"  run {repeat} {task} {path:17s} {seconds:7.2f} s, cpu {cpu:7.2f} s",
                        flush=True,
                    )
        assert hf_model is hf.model
        counts = token_counts(tok, outputs)
        checks = parity(outputs, {it.item_id: it.prompt for it in bench.items})
    results = {}
    for task, paths in best.items():
        cpu = best_cpu[task]
        results[task] = {
            path: {
                "seconds": s,
                "seconds_per_item": s / args.items,
                "tokens_per_second": counts[task][path] / s,
                "tokens": counts[task][path],
                "ratio_to_hf": s / paths["hf"],
                "cpu_seconds": cpu[path],
                "cpu_seconds_per_item": cpu[path] / args.items,
                "cpu_tokens_per_second": counts[task][path] / cpu[path],
                "cpu_ratio_to_hf": cpu[path] / cpu["hf"],
            }
            for path, s in paths.items()
        }
    k = 3
    targets = {
        "single_model_max_ratio": 1.0,
        "composition_models": k,
        "composition_max_ratio": k + 1.0,
    }
    met = {
        f"{task}/{path}": {
            clock: r[key]
            <= (targets["composition_max_ratio"] if path.startswith("compose") else 1.0)
            for clock, key in (("wall", "ratio_to_hf"), ("cpu", "cpu_ratio_to_hf"))
        }
        for task, rows in results.items()
        for path, r in rows.items()
        if path != "hf"
    }
    record = {
        "config": {
            **vars(args),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": __import__("lm_eval").__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "parameters": sum(p.numel() for p in base.parameters()),
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_seconds": time.time() - started,
        "results": results,
        "parity": checks,
        "targets": targets,
        "targets_met": met,
    }
    from mergelab.outputs import atomic_output_file

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(args.out, force=True) as tmp_out:
        tmp_out.write_text(json.dumps(record, indent=1))
    report(record)
    print(f"wrote {args.out}")
    return 0


def token_counts(tok, outputs: dict) -> dict[str, dict[str, int]]:
    """Tokens each path processed: gen — the tokens mergelab generated (``n_tokens`` of its
    records; hf and lm-eval paths produce the same texts, see :func:`parity`, so the same
    count); ll — context + continuation tokens of every request."""
    gen = outputs["gen"]
    single = sum(r["n_tokens"] for r in gen["mergelab_eval"].values())
    composed = sum(r["n_tokens"] for r in gen["compose_eval"].values())
    counts: dict[str, dict[str, int]] = {
        "gen": {p: composed if p.startswith("compose") else single for p in gen},
        "ll": {},
    }
    for path, out in outputs["ll"].items():
        counts["ll"][path] = sum(
            len(tok(s["arguments"][j][0] + s["arguments"][j][1])["input_ids"])
            for s in out
            for j in range(len(s["arguments"]))
        )
    return counts


def parity(outputs: dict, questions_by_id: dict[str, str]) -> dict[str, float]:
    """Share of items where mergelab's outputs equal hf's (the single model): greedy texts
    (gen, through lm-eval and through ``evaluate``; the composition's two paths to each other)
    and log-likelihoods within 1e-4 nats (ll)."""
    gen = outputs["gen"]
    lm_eval_texts = {
        path: {s["doc"]["question"]: s["resps"][0][0] for s in gen[path]}
        for path in ("hf", "mergelab_lm_eval", "compose_lm_eval")
    }
    questions = sorted(lm_eval_texts["hf"])
    by_question = {
        path: {questions_by_id[item_id]: r["text"] for item_id, r in gen[path].items()}
        for path in ("mergelab_eval", "compose_eval")
    }

    def share(a: dict, b: dict) -> float:
        return sum(a[q] == b[q] for q in questions) / len(questions)

    hf_ll = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in outputs["ll"]["hf"]}
    ml_ll = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in outputs["ll"]["mergelab_lm_eval"]}
    close = sum(all(abs(a - b) <= 1e-4 for a, b in zip(hf_ll[d], ml_ll[d])) for d in hf_ll) / len(
        hf_ll
    )
    return {
        "gen_same_text_share_mergelab_lm_eval": share(
            lm_eval_texts["hf"], lm_eval_texts["mergelab_lm_eval"]
        ),
        "gen_same_text_share_mergelab_eval": share(
            lm_eval_texts["hf"], by_question["mergelab_eval"]
        ),
        "gen_same_text_share_compose_paths": share(
            lm_eval_texts["compose_lm_eval"], by_question["compose_eval"]
        ),
        "ll_same_loglikelihood_share": close,
    }


def report(record: dict) -> None:
    cfg = record["config"]
    print(
        f"\n{cfg['items']} items per task, batch {cfg['batch_size']}, {cfg['parameters']} "
        f"parameters, {cfg['max_new_tokens']} new tokens"
    )
    for task, rows in record["results"].items():
        print(
            f"  {task}: {'path':17s} {'s/item':>8s} {'tok/s':>8s} {'× hf':>6s} "
            f"{'cpu s/item':>10s} {'cpu × hf':>8s}"
        )
        for path, r in rows.items():
            print(
                f"      {path:17s} {r['seconds_per_item']:8.4f} {r['tokens_per_second']:8.0f} "
                f"{r['ratio_to_hf']:6.2f} {r['cpu_seconds_per_item']:10.4f} "
                f"{r['cpu_ratio_to_hf']:8.2f}"
            )
    print(f"  parity with hf: {record['parity']}")
    missed = [f"{k} ({c})" for k, ok in record["targets_met"].items() for c in ok if not ok[c]]
    print(f"  targets: {'all met' if not missed else 'MISSED ' + ', '.join(missed)}")


if __name__ == "__main__":
    raise SystemExit(main())
