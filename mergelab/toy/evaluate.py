"""Run a :class:`~mergelab.candidate.Candidate` on a toy task and read off its predictions.

Every row of a toy table — base, expert, composition, each weight merge — goes through these
two functions, i.e. through the same ``Candidate`` calls.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from ..candidate import GenerationSettings
from .tasks import AlignedTask, GenerativeTask


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
