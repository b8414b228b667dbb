"""How far the lm-eval bridge's log-likelihoods are from lm-eval's own ``hf`` model, and why.

One tiny randomly initialised model per architecture (GPT-2 and Llama shapes, character
tokenizer, ``initializer_range`` 0.3 as in tests/test_lm_eval_bridge.py), the same seeded
loglikelihood requests (random contexts and continuations over the alphabet) scored by
``HFLM._loglikelihood_tokens`` and ``MergelabLM._loglikelihood_tokens``, in float32 and in
bfloat16. The cause check: each request scored by hand, one sequence at a time, with the
log-softmax, the gather and the sum in the model's dtype (``hf``'s order) and in float64 after
the logits (the reference both are measured against; the bridge takes them in float32). Writes
``results/eval/lm_eval_bf16_gap.json`` (per setting: max and mean |Δ log-likelihood| in nats,
requests, versions).

    python benchmarks/lm_eval_bf16_gap.py
"""

from __future__ import annotations

import json
import random
from importlib.metadata import version
from pathlib import Path

import torch
from lm_eval.models.huggingface import HFLM

from mergelab.eval.lm_eval_bridge import MergelabLM
from mergelab.model_candidate import ModelCandidate
from mergelab.outputs import atomic_output_file
from mergelab.tiny import char_tokenizer, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "eval" / "lm_eval_bf16_gap.json"
N_REQUESTS, SEED = 200, 0


@torch.no_grad()
def by_hand(model, reqs, dtype: torch.dtype) -> list[float]:
    """Each request alone (no padding): log-softmax of the model's logits, gathered and summed,
    all in ``dtype`` (hf's order in bfloat16 is ``dtype=bfloat16``; float64 is the reference)."""
    out = []
    for _, context, continuation in reqs:
        ids = torch.tensor([(context + continuation)[:-1]])
        logits = model(input_ids=ids).logits[0, -len(continuation) :].to(dtype)
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum()))
    return out


def requests(tok, n: int, seed: int) -> list[tuple[None, list[int], list[int]]]:
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789 .,=+-*")
    out = []
    for _ in range(n):
        context = "".join(rng.choices(alphabet, k=rng.randint(4, 40)))
        continuation = "".join(rng.choices(alphabet, k=rng.randint(1, 12)))
        out.append((None, tok.encode(context), tok.encode(continuation)))
    return out


def gaps(a: list[float], b: list[float]) -> dict[str, float]:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)}


def main() -> None:
    tok = char_tokenizer()
    reqs = requests(tok, N_REQUESTS, SEED)
    rows = []
    for architecture in ("gpt2", "llama"):
        model = tiny_causal_lm(len(tok), architecture=architecture, seed=0, initializer_range=0.3)
        for dtype in (torch.float32, torch.bfloat16):
            m = model.to(dtype).eval()
            theirs = HFLM(pretrained=m, tokenizer=tok, batch_size=8)
            hf = [s for s, _ in theirs._loglikelihood_tokens(reqs, disable_tqdm=True)]
            ours = MergelabLM(ModelCandidate(m, tok), batch_size=8)
            bridge = [s for s, _ in ours._loglikelihood_tokens(reqs, disable_tqdm=True)]
            exact = by_hand(m, reqs, torch.float64)
            rows.append(
                {
                    "architecture": architecture,
                    "dtype": str(dtype).removeprefix("torch."),
                    "bridge_vs_hf": gaps(bridge, hf),
                    "hf_vs_its_order_by_hand": gaps(hf, by_hand(m, reqs, dtype)),
                    "bridge_vs_float64_after_logits": gaps(bridge, exact),
                    "hf_vs_float64_after_logits": gaps(hf, exact),
                    "mean_abs_loglikelihood": sum(abs(x) for x in hf) / len(hf),
                }
            )
            print(json.dumps(rows[-1]))
    record = {
        "what": "max/mean |log-likelihood difference| in nats, bridge vs lm-eval's hf model",
        "requests": N_REQUESTS,
        "seed": SEED,
        "versions": {p: version(p) for p in ("torch", "transformers", "lm_eval")},
        "rows": rows,
    }
    with atomic_output_file(OUT) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
