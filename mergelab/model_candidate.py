"""One causal LM — a base, an expert or a weight merge — as a :class:`~mergelab.candidate.Candidate`.

It runs the same decoding loop as a composition (:mod:`mergelab.compose.decoding`), as the
composition of one model, so sampling, stop strings and EOS handling are identical for every row
of a comparison. It sits above :mod:`mergelab.compose` in the layering: ``candidate`` (the
protocol) → ``compose`` → ``model_candidate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mergelab.compose.decoding import DecodingCandidate
from mergelab.compose.formula import Composition
from mergelab.compose.runners import ModelRunner
from mergelab.compose.vocab import tokenizer_vocab_size


class ModelCandidate(DecodingCandidate):
    """One causal LM (a base, an expert or a weight merge) as a Candidate.

    ``use_cache=False`` recomputes the prefix at every step (a reference for tests).
    ``eos_token_ids``: the ids that end a generation; default the tokenizer's EOS id plus every id
    in the model's ``generation_config.eos_token_id`` (transformers' convention: a list is fine).
    ``name`` defaults to the model's ``name_or_path`` (else its class name).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str | None = None,
        *,
        use_cache: bool = True,
        eos_token_ids: Sequence[int] | None = None,
    ):
        config = getattr(model, "config", None)
        name = name or getattr(config, "_name_or_path", "") or type(model).__name__
        runner = ModelRunner([model], [name], tokenizer_vocab_size(tokenizer), use_cache=use_cache)
        super().__init__(
            runner,
            Composition.single(name),
            tokenizer,
            name=name,
            eos_token_ids=eos_token_ids,
            kind="ModelCandidate",
        )
        self.model = model
        self.config = config  # the model's (transformers' habit: candidate.config.vocab_size)
