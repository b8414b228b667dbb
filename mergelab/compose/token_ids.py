"""transformers' ``model.generate`` call on any candidate: token ids in, token ids out.

    enc = tokenizer(prompts, return_tensors="pt", padding=True)      # left padding
    out = candidate.generate(**enc, max_new_tokens=16)                # LongTensor [B, T + new]
    out = candidate.generate(**enc, do_sample=True, num_return_sequences=3, seed=0,
                             return_dict_in_generate=True, output_scores=True)
    out.sequences, out.scores                                         # as transformers returns

What is transformers' here:

* ``sequences`` is each input row as given (its padding included) followed by the new tokens: an
  EOS that ended a row is kept, and the row is then filled with ``pad_token_id`` up to the
  longest row; a row ended by a stop string keeps the token that completed it (so decoding the
  row shows the stop string, as in transformers). Stop strings are checked by transformers'
  ``StopStringCriteria`` on the prompt and the new tokens together, so one that begins in the
  prompt's last characters and ends in a new token ends the row, as in ``model.generate``. Rows are repeated ``num_return_sequences``
  times, prompt by prompt (``repeat_interleave``); more than one needs ``do_sample``.
* Without ``generation_config`` the candidate's own is used (``candidate.generation_config``:
  a model's, or the composition's), updated by the keyword arguments.
* ``scores`` (with ``output_scores``) are the processed scores of each step, ``[rows, V]``: for
  one model its logits after the logits processors, for a composition its composed
  log-probabilities after them; when sampling, after temperature / top-k / top-p (transformers'
  warpers), with ``-inf`` where they rule a token out.

What is mergelab's: the whole batch is decoded together unless ``batch_size`` says otherwise;
sampling draws per row from ``seed`` (the module docstring of :mod:`mergelab.compose.decoding`),
so a seed gives the same tokens in any batch but not transformers' tokens for that seed.
``output_logits``, ``output_attentions`` and ``output_hidden_states`` are refused: a composition
has several models' logits and states, none of them its own; use ``candidate.token_logprobs``
(teacher-forced log-probs of ``sequences``) or the models themselves.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from ..candidate import generation_settings
from .sampling import batch_order, warp_logprobs

# generate() keyword arguments that shape the returned object rather than the decoding.
OUTPUT_OPTIONS = ("return_dict_in_generate", "output_scores")
REFUSED_OUTPUTS = ("output_logits", "output_attentions", "output_hidden_states")
# Accepted and not needed: mergelab already has the tokenizer, and always uses a KV cache.
IGNORED_KWARGS = ("tokenizer", "use_cache")


def refuse_output_options(kwargs: dict[str, Any], settings: Any = None) -> None:
    """The text call ``generate(prompts, settings)`` returns Generations: output options of
    transformers' call are refused there, by name, rather than ignored."""
    given = [k for k in (*OUTPUT_OPTIONS, *REFUSED_OUTPUTS) if kwargs.get(k)]
    given += [k for k in OUTPUT_OPTIONS if getattr(settings, k, False) and k not in given]
    if given:
        raise ValueError(
            f"{', '.join(given)}: these shape transformers' return value, which "
            "generate(input_ids=..., ...) returns; generate(prompts, settings) returns one "
            "Generation per prompt (with token_ids and logprobs)"
        )
    for k in (*OUTPUT_OPTIONS, *REFUSED_OUTPUTS):
        kwargs.pop(k, None)


def generate_token_ids(
    candidate: Any,
    prompts: Any = None,
    settings: Any = None,
    *,
    attention_mask: torch.Tensor | None = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    **kwargs: Any,
) -> Any:
    """``candidate.generate(input_ids=..., attention_mask=..., generation_config=..., **kwargs)``
    as transformers' ``model.generate``: see the module docstring."""
    input_ids = _input_ids(prompts, kwargs)
    config = kwargs.pop("generation_config", None)
    if config is not None and settings is not None:
        raise ValueError("pass generation_config or settings, not both")
    config = config if config is not None else settings
    if config is None:
        config = candidate.generation_config
    refused = [k for k in REFUSED_OUTPUTS if kwargs.pop(k, None) or getattr(config, k, None)]
    if refused:
        raise ValueError(
            f"{', '.join(refused)} not supported: a composition has no logits or states of its "
            "own; use output_scores, or candidate.token_logprobs(sequences)"
        )
    options = {k: bool(kwargs.pop(k, getattr(config, k, False))) for k in OUTPUT_OPTIONS}
    pad = kwargs.pop("pad_token_id", None)
    pad = pad if pad is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else candidate.pad_id
    for k in IGNORED_KWARGS:
        kwargs.pop(k, None)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    batch = input_ids.shape[0]
    n = _num_return_sequences(config, kwargs)
    # One batch, as transformers decodes it (unless batch_size is given).
    kwargs.setdefault("batch_size", max(1, batch * n))
    settings = generation_settings(_copy(config), **kwargs)
    if settings.stop_strings and getattr(candidate, "_plain_loop", False):
        # transformers' own criterion, on the prompt and the new tokens together: a stop string
        # that begins in the prompt's last characters and ends in a new token ends the row, as in
        # model.generate (the text call looks at the new text only, as lm-eval's `until`).
        from transformers import StopStringCriteria

        criterion = StopStringCriteria(candidate.tokenizer, list(settings.stop_strings))
        stopping_criteria = [*_as_hook_list(stopping_criteria), criterion]
        settings = replace(settings, stop_strings=())
    recorder = None
    if options["output_scores"]:
        if settings.batch_size < batch * n:
            raise ValueError("output_scores needs the whole batch decoded at once: drop batch_size")
        recorder = _ScoreRecorder()
        logits_processor = [*(logits_processor or []), recorder]
    generations = candidate.generate(
        input_ids,
        settings,
        attention_mask=attention_mask,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
    )
    new = [
        g.token_ids + ([g.eos_token_id] if g.eos_token_id is not None else []) for g in generations
    ]
    width = max((len(t) for t in new), default=0)
    tail = torch.full((len(new), width), int(pad), dtype=torch.long)
    for row, tokens in enumerate(new):
        tail[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    sequences = torch.cat([input_ids.repeat_interleave(n, dim=0), tail.to(input_ids.device)], dim=1)
    if not options["return_dict_in_generate"]:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    scores = None
    if recorder is not None:
        _, encoded = candidate.encode_prompts(input_ids, attention_mask)
        scores = recorder.in_input_order(batch_order([e for e in encoded for _ in range(n)]))
        if settings.do_sample:
            scores = tuple(
                warp_logprobs(s, settings.temperature, settings.top_k, settings.top_p)
                for s in scores
            )
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores)


def _input_ids(prompts: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    given = [x for x in (prompts, kwargs.pop("input_ids", None), kwargs.pop("inputs", None))]
    given = [x for x in given if x is not None]
    if len(given) != 1:
        raise ValueError(
            "give the prompt ids once: generate(input_ids=ids, attention_mask=mask, ...)"
            if given
            else "generate needs prompts (a list of strings) or input_ids (a tensor)"
        )
    ids = given[0]
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a tensor of token ids [batch, length], not {type(ids).__name__} "
            "(strings go to generate(prompts, settings))"
        )
    return ids if ids.dim() == 2 else ids.reshape(1, -1)


def _as_hook_list(hooks: Any) -> list[Any]:
    """transformers' stopping-criteria argument (None, one callable or a list) as a list."""
    if hooks is None:
        return []
    return list(hooks) if isinstance(hooks, (list, tuple)) else [hooks]


def _num_return_sequences(config: Any, kwargs: dict[str, Any]) -> int:
    n = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", None))
    return int(n or 1)


def _copy(config: Any) -> Any:
    """A GenerationConfig without the output options (consumed here); other settings as given."""
    if config is None or not hasattr(config, "to_dict"):
        return config
    config = copy.deepcopy(config)
    for k in OUTPUT_OPTIONS:
        if hasattr(config, k):
            setattr(config, k, False)
    return config


class _ScoreRecorder:
    """A logits processor, last in the list, that keeps each step's processed scores."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(scores.detach().clone())
        return scores

    def in_input_order(self, order: list[int]) -> tuple[torch.Tensor, ...]:
        """Each step's ``[rows, V]`` in input order; the loop decoded row r as input row
        ``order[r]``."""
        index = torch.tensor(order, dtype=torch.long)
        out = []
        for step in self.steps:
            ordered = torch.empty_like(step)
            ordered[index.to(step.device)] = step
            out.append(ordered)
        return tuple(out)
