"""Run a :class:`~mergelab.candidate.Candidate` on a toy task and score its predictions.

Every row of a toy table — base, expert, composition, each weight merge — goes through these
functions, i.e. through the same ``Candidate`` calls.

Why the aligned protocol has its own evaluator instead of :mod:`mergelab.compare`'s: there the
model is a language model — the logits at ``t`` are scored against the *next* token, and an
answer is generated token by token. In the authors' aligned protocol the logits at ``t`` (which
see ``x[:t+1]``) are trained to predict ``y[t]``, the output *at the same position*: the whole
answer comes out of one forward pass as a per-position argmax, with no shift, no prompt and no
stopping decision. Scored as an LM, every prediction would be off by one position.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from mergelab.candidate import GenerationSettings
from mergelab.toy import AlignedTask, GenerativeTask, LetterMap


@torch.no_grad()
def aligned_predictions(
    candidate, task: AlignedTask, inputs: Sequence[str], *, batch_size: int = 256
) -> list[str]:
    """Per-position argmax of ``candidate.token_logprobs(x)``: ``out[t] = argmax p(y_t | x[:t+1])``.

    Inputs are batched by length, so no padding ever enters a forward pass.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, x in enumerate(inputs):
        by_length[len(x)].append(i)
    out: list[str | None] = [None] * len(inputs)
    for idx in by_length.values():
        for s in range(0, len(idx), batch_size):
            rows = idx[s : s + batch_size]
            xs = [inputs[i] for i in rows]
            input_ids, mask = task.prompts(xs)
            lp = candidate.token_logprobs(input_ids, mask)
            for i, pred in zip(rows, task.decode_logprobs(lp, xs)):
                out[i] = pred
    return out  # type: ignore[return-value]


def generative_predictions(
    candidate, task: GenerativeTask, inputs: Sequence[str], *, batch_size: int = 64
) -> list[str | None]:
    """Greedy generation from ``x [SEP]`` until EOS; ``None`` where no EOS came in time.

    The budget is ``len(x) + 1`` new tokens (the answer plus EOS), so a run that does not stop
    exactly where the target does never counts as a match.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, x in enumerate(inputs):
        by_length[len(x)].append(i)
    out: list[str | None] = [None] * len(inputs)
    for length, idx in by_length.items():
        settings = GenerationSettings(max_new_tokens=length + 1, batch_size=batch_size)
        gens = candidate.generate([task.prompt(inputs[i]) for i in idx], settings)
        for i, g in zip(idx, gens):
            if g.finish_reason == "eos":
                out[i] = "".join(task.tokenizer.convert_ids_to_tokens(g.token_ids))
    return out


def exact_match(predictions: Sequence[str | None], targets: Sequence[str | None]) -> np.ndarray:
    """Per-example 0/1: prediction equals target exactly (an undefined target ``None`` counts 0)."""
    return np.array(
        [float(t is not None and p == t) for p, t in zip(predictions, targets, strict=True)]
    )


def skill_success(
    inputs: Sequence[str], predictions: Sequence[str], skill: LetterMap
) -> np.ndarray:
    """Per-example 0/1 over the examples the skill touches: every touched position rewritten.

    Only the positions where ``skill`` changes the input count (other positions are the joint
    exact match's business); examples without such a position are left out (empty array if none).
    """
    out = []
    for x, p in zip(inputs, predictions, strict=True):
        idx = [i for i, c in enumerate(x) if skill.touches(c)]
        if idx:
            out.append(float(len(p) == len(x) and all(p[i] == skill(x[i]) for i in idx)))
    return np.array(out)
