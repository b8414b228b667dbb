"""mergelab demo: build a tiny base and two experts, merge them with every method, compare.

Everything is made here, offline, in well under a minute on a CPU:

1. a tiny Llama (2 layers, hidden 64) is trained briefly on a *copy* task (each token repeats the
   previous one) — the base;
2. two experts are fine-tuned from it, each on its own task: ``count`` (each token is the
   previous + 1, mod 16) and ``skip`` (previous + 3, mod 16). A marker token at the start of every
   sequence says which task it is, so one model can in principle do both;
3. base and experts are saved as Hugging Face checkpoint folders and merged with every registered
   method through the same streamed engine as ``mergelab merge``; each merge is loaded back with
   ``AutoModelForCausalLM``;
4. every model is scored on held-out sequences of both tasks: next-token loss (nats) and accuracy
   (greedy next token correct), printed as a table and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

N_NUMBERS = 16  # tokens 0..15 are numbers
MARKERS = {"copy": 16, "count": 17, "skip": 18}  # a task marker starts every sequence
STEP = {"copy": 0, "count": 1, "skip": 3}
VOCAB = 19
SEQ_LEN = 24

# How each method is run in the demo (methods registered later run with their defaults + base).
METHOD_SETUP: dict[str, dict[str, Any]] = {
    "slerp": {"base": False, "params": {"t": 0.5}},
    "linear": {"base": False},
    "task_arithmetic": {"params": {"lambda": 1.0}},
    "ties": {"params": {"density": 0.5}},
    "dare_linear": {"params": {"density": 0.5}},
    "dare_ties": {"params": {"density": 0.5}},
    "della": {"params": {"density": 0.5, "epsilon": 0.2}},
    "della_linear": {"params": {"density": 0.5, "epsilon": 0.2}},
    "nuslerp": {"base": True},  # interpolate the two task vectors around the base
    "multislerp": {"base": True},
    "nearswap": {"params": {"t": 0.01}},
}


def task_batch(task: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` sequences ``[marker, x0, x0 + s, x0 + 2s, ...] mod 16``, shape ``[n, SEQ_LEN]``."""
    start = torch.randint(0, N_NUMBERS, (n, 1), generator=generator)
    numbers = (start + STEP[task] * torch.arange(SEQ_LEN - 1)) % N_NUMBERS
    if task == "copy":  # copy: random runs, so the model learns "repeat the last token"
        runs = torch.randint(0, N_NUMBERS, (n, (SEQ_LEN - 1) // 3 + 1), generator=generator)
        numbers = runs.repeat_interleave(3, dim=1)[:, : SEQ_LEN - 1]
    marker = torch.full((n, 1), MARKERS[task])
    return torch.cat([marker, numbers], dim=1)


def demo_model(seed: int):
    """The demo's tiny Llama (hidden 64, 2 layers, grouped-query attention), in train mode."""
    from mergelab.tiny import tiny_llama

    model = tiny_llama(
        VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_positions=SEQ_LEN,
        seed=seed,
        pad_token_id=None,  # no padding row: every id is a number or a marker
    )
    return model.train()  # the demo trains it


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of tokens 2.. given their prefix (token 1 is the random start)."""
    logits = model(input_ids=batch).logits[:, 1:-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 2:].reshape(-1))


def train(model, task: str, steps: int, seed: int, lr: float = 3e-3):
    """A few Adam steps on one task; returns the model in eval mode."""
    from mergelab.tiny import train as train_loop

    generator = torch.Generator().manual_seed(seed)
    batches = (task_batch(task, 32, generator) for _ in range(steps))
    train_loop(model, batches, next_token_loss, lr=lr, optimizer="adam")
    return model


@torch.no_grad()
def evaluate(model, held_out: dict[str, torch.Tensor]) -> dict[str, float]:
    scores = {}
    for task, batch in held_out.items():
        logits = model(input_ids=batch).logits[:, 1:-1]
        scores[f"{task}_loss"] = float(
            F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 2:].reshape(-1))
        )
        scores[f"{task}_acc"] = float((logits.argmax(-1) == batch[:, 2:]).float().mean())
    return scores


@dataclass
class DemoRow:
    model: str
    count_loss: float
    count_acc: float
    skip_loss: float
    skip_acc: float
    seconds: float = 0.0
    error: str | None = None


def run_demo(seed: int = 0, steps: int = 60, progress: bool = False) -> list[DemoRow]:
    """Train base + experts, merge with every registered method, score all. Returns the rows."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()  # transformers' own loading/saving bars
    try:
        return _run_demo(seed, steps, progress)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _run_demo(seed: int, steps: int, progress: bool) -> list[DemoRow]:
    from transformers import AutoModelForCausalLM

    from mergelab.merge import get_merge_method, list_merge_methods
    from mergelab.merge.checkpoint import merge_checkpoints

    held_out = {
        t: task_batch(t, 64, torch.Generator().manual_seed(10_000 + i))
        for i, t in enumerate(("count", "skip"))
    }
    base = train(demo_model(seed), "copy", steps, seed)
    experts = {}
    for i, task in enumerate(("count", "skip")):
        expert = demo_model(seed)
        expert.load_state_dict(base.state_dict())
        experts[task] = train(expert, task, steps, seed + 1 + i)

    rows = [DemoRow("base", **evaluate(base, held_out))]
    rows += [DemoRow(f"expert: {t}", **evaluate(m, held_out)) for t, m in experts.items()]
    with tempfile.TemporaryDirectory(prefix="mergelab-demo-") as tmp:
        root = Path(tmp)
        base.save_pretrained(root / "base")
        for task, model in experts.items():
            model.save_pretrained(root / task)
        for method in list_merge_methods():
            setup = METHOD_SETUP.get(method, {})
            m = get_merge_method(method)
            use_base = setup.get("base", m.needs_base)
            models = [root / "count", root / "skip"][: m.n_experts[1] or 2]  # e.g. nearswap: 1
            start = time.perf_counter()
            try:
                out = merge_checkpoints(
                    method,
                    root / "base" if use_base else None,
                    models,
                    output=root / f"merged-{method}",
                    params=setup.get("params"),
                    seed=seed,
                    progress=progress,
                )
                merged = AutoModelForCausalLM.from_pretrained(out).eval()
                scores = evaluate(merged, held_out)
                rows.append(DemoRow(method, **scores, seconds=time.perf_counter() - start))
            except (ValueError, KeyError) as exc:  # a method that cannot run on this set-up
                nan = float("nan")
                rows.append(DemoRow(method, nan, nan, nan, nan, error=str(exc)))
    return rows


def format_table(rows: list[DemoRow]) -> str:
    lines = [
        f"{'model':22s} {'count loss':>10s} {'count acc':>9s} {'skip loss':>10s} {'skip acc':>9s}"
        f" {'mean acc':>9s}",
        "-" * 74,
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.model:22s} failed: {r.error}")
            continue
        mean = (r.count_acc + r.skip_acc) / 2
        lines.append(
            f"{r.model:22s} {r.count_loss:10.3f} {r.count_acc:9.1%} {r.skip_loss:10.3f} "
            f"{r.skip_acc:9.1%} {mean:9.1%}"
        )
    return "\n".join(lines)


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="tiny end-to-end demo: train a base and two experts, merge with every method",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the models and their training (default 0)"
    )
    p.add_argument("--steps", type=int, default=60, help="training steps per model")
    # The models are tiny: more threads only add synchronisation (and contend on shared machines).
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--output", help="also write the rows and the config as JSON here")
    p.add_argument("--force", action="store_true", help="replace an earlier demo --output")
    p.set_defaults(func=main)
    return p


def _is_demo_record(path: Path) -> bool:
    """Whether ``path`` holds what ``mergelab demo --output`` writes (the only file it replaces)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and set(record) == {"config", "rows"}


def main(args: argparse.Namespace) -> int:
    from mergelab.outputs import atomic_output_file, check_output_file

    output = dict(force=args.force, written_by_mergelab=_is_demo_record)
    if args.output:
        check_output_file(args.output, **output)  # refuse before any training
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = run_demo(seed=args.seed, steps=args.steps)
    print(format_table(rows))
    print(
        f"\nheld-out next-token loss (nats) and accuracy on each expert's task; "
        f"{time.perf_counter() - start:.1f} s"
    )
    if args.output:
        record = {
            "config": {"seed": args.seed, "steps": args.steps, "method_setup": METHOD_SETUP},
            "rows": [asdict(r) for r in rows],
        }
        with atomic_output_file(args.output, **output) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
        print(f"results: {args.output}")
    return 0
