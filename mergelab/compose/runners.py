"""Component runners: produce each component model's next-token log-probs, step by step.

A runner owns the models of a candidate and their KV caches. The decoding loop
(:mod:`mergelab.compose.decoding`) asks it for

* ``prefill(input_ids, attention_mask, position_ids)`` → one ``[B, V]`` logit tensor per
  component, for the token after the (left-padded) prompt;
* ``step(next_ids, attention_mask, position_ids)`` → the same after appending ``next_ids [B, 1]``;
* ``teacher_forced(input_ids, attention_mask, position_ids)`` → ``[B, T, V]`` per component;
* ``extend(input_ids, attention_mask, position_ids)`` → ``[B, T, V]`` per component after
  appending ``T`` tokens to the caches (the first call fills fresh caches), and
  ``rollback(n)`` → drop the last ``n`` cache slots (``DynamicCache.crop``): what speculative
  decoding (:mod:`mergelab.compose.speculative`) needs to verify a drafted block in one forward.

All are float32 *logits* over the tokenizer's ``V`` ids (truncated, see
:mod:`mergelab.compose.vocab`); the candidate normalises them only where it needs log-probs
(the composition's own log-softmax removes each model's normaliser anyway). :class:`ModelRunner` runs each model separately with its own
transformers ``Cache`` object; the LoRA fast path (:mod:`mergelab.compose.lora`) runs base and
adapters in one batched forward with one cache. Models that return no cache (any module returning
logits) are run on the whole prefix at every step instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .vocab import check_model_vocab, model_identity, truncate_logits


def new_cache(model: nn.Module) -> Any:
    """An empty ``DynamicCache`` for ``model`` (the transformers cache class, no hand-made one)."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers without the config argument
        cache = DynamicCache()
    # Sliding-window layers drop old states unless told to keep them for a rollback (crop).
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def has_sliding_window(model: nn.Module) -> bool:
    """Whether ``model``'s cache has sliding-window layers (their window counts cache slots)."""
    cache = new_cache(model)
    return any(getattr(cache, "is_sliding", None) or [])


def crop_cache(cache: Any, n: int) -> None:
    """Drop the last ``n`` slots of a transformers cache (``crop(-n)``: transformers 4.x and 5.x)."""
    if n > 0:
        cache.crop(-n)


class ModelCall:
    """Calls one causal LM with whatever of (mask, positions, cache) its ``forward`` accepts.

    transformers 5.x names the cache argument ``cache`` (4.x: ``past_key_values``); plain modules
    may accept neither, and then get only ``input_ids``.
    """

    def __init__(self, model: nn.Module, name: str = "model", vocab_size: int | None = None):
        self.model = model
        self.name = name
        self.vocab_size = vocab_size
        forward = model.forward if hasattr(model, "forward") else model
        params = inspect.signature(forward).parameters
        self.accepts_mask = "attention_mask" in params
        self.accepts_positions = "position_ids" in params
        self.cache_argument = next((a for a in ("cache", "past_key_values") if a in params), None)
        self.accepts_use_cache = "use_cache" in params
        self.accepts_logits_to_keep = "logits_to_keep" in params
        if vocab_size is not None:
            check_model_vocab(model, vocab_size, name)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
        *,
        last_only: bool,
    ) -> tuple[torch.Tensor, Any]:
        """Returns (float logits ``[B, T or 1, V]`` truncated to the tokenizer, returned cache)."""
        kwargs: dict[str, Any] = {}
        if self.accepts_mask:
            kwargs["attention_mask"] = attention_mask
        if self.accepts_positions:
            kwargs["position_ids"] = position_ids
        if self.cache_argument is not None and cache is not None:
            kwargs[self.cache_argument] = cache
        if self.accepts_use_cache:
            kwargs["use_cache"] = cache is not None
        if last_only and self.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # do not project every prompt position onto the vocab
        out = self.model(input_ids, **kwargs)
        if isinstance(out, torch.Tensor):
            logits, returned = out, None
        elif isinstance(out, tuple):
            logits, returned = out[0], None
        else:
            logits = out.logits
            returned = getattr(out, "cache", None)
            if returned is None:
                returned = getattr(out, "past_key_values", None)
        if last_only:
            logits = logits[:, -1:]
        if self.vocab_size is not None:
            logits = truncate_logits(logits, self.vocab_size, self.name)
        return logits.float(), returned

    @property
    def may_cache(self) -> bool:
        return self.cache_argument is not None


def last_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` logits → the last position's ``[B, V]``, float32."""
    return logits[:, -1].float()


def eval_mode(model: nn.Module) -> nn.Module:
    """``model`` in eval mode: models built from a config start in train mode (dropout on), and
    decoding needs eval mode."""
    if isinstance(model, nn.Module) and model.training:
        model.eval()
    return model


class ComponentRunner:
    """What :class:`ModelRunner` and the LoRA runner share: ``prefill`` starts fresh caches,
    ``step`` is :meth:`extend` by one token, keeping the last position's logits, and the
    bookkeeping of the tokens appended so far (``_ids``, ``_positions``: the prefix a model
    without a cache recomputes) and of the caches (``_caches``, one per forward call; ``None``
    for a model that cannot cache), which :meth:`rollback` crops."""

    _caches: list[Any]
    _ids: torch.Tensor | None
    _positions: torch.Tensor | None

    def _reset(self) -> None:
        raise NotImplementedError

    def extend(self, input_ids, attention_mask, position_ids, last_only=False):
        raise NotImplementedError

    def _append(self, ids: torch.Tensor, positions: torch.Tensor) -> bool:
        """Record appended tokens; True when they are the first (the caches are to be made)."""
        first = self._ids is None
        if first:
            self._ids, self._positions = ids, positions
        else:
            self._ids = torch.cat([self._ids, ids], dim=1)
            self._positions = torch.cat([self._positions, positions], dim=1)
        return first

    def _forward(
        self, call: ModelCall, ids, mask, positions, cache, last_only: bool
    ) -> tuple[torch.Tensor, Any]:
        """One forward of ``call`` on the appended ``ids``: with its cache, or (``cache`` None)
        over the whole recorded prefix, keeping the appended positions' logits."""
        self.forward_passes += 1
        if cache is not None:
            return call(ids, mask, positions, cache, last_only=last_only)
        logits, _ = call(self._ids, mask, self._positions, None, last_only=last_only)
        return logits[:, -ids.shape[1] :], None

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` appended tokens (cache slots) of every model."""
        if n <= 0:
            return
        assert self._ids is not None and n <= self._ids.shape[1], "rollback past the start"
        self._ids, self._positions = self._ids[:, :-n], self._positions[:, :-n]
        for cache in self._caches:
            if cache is not None:
                crop_cache(cache, n)

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        self._reset()
        return self.step(input_ids, attention_mask, position_ids)

    @torch.no_grad()
    def step(
        self, next_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        return [last_logits(z) for z in self.extend(next_ids, attention_mask, position_ids, True)]


class ModelRunner(ComponentRunner):
    """Runs ``k`` separate models over the same batch; each keeps its own KV cache.

    ``use_cache=False`` recomputes the whole prefix at every step (the naive reference loop).
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        names: Sequence[str],
        vocab_size: int,
        *,
        use_cache: bool = True,
    ):
        if len(models) != len(names):
            raise ValueError(f"{len(models)} models for {len(names)} names")
        models = [eval_mode(m) for m in models]
        self.names = tuple(names)
        self.models = dict(zip(self.names, models))
        self.vocab_size = vocab_size
        self.use_cache = use_cache
        self.calls = [ModelCall(m, n, vocab_size) for m, n in zip(models, names)]
        self.forward_passes = 0
        self._caches: list[Any] = []
        self._ids: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._depth = 0

    def describe_models(self) -> dict[str, Any]:
        return {n: model_identity(m) for n, m in self.models.items()}

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Decoding state lives until the outermost session ends (sessions nest: a teacher-forced
        call inside a decoding loop, e.g. from a draft, leaves the loop's caches alone)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._reset()

    def _reset(self) -> None:
        self._caches, self._ids, self._mask, self._positions = [], None, None, None

    @torch.no_grad()
    def extend(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        last_only: bool = False,
    ) -> list[torch.Tensor]:
        """Append ``input_ids [B, T]``; logits ``[B, T, V]`` (``[B, 1, V]`` if ``last_only``).

        ``attention_mask [B, S + T]`` covers every cache slot; ``position_ids [B, T]``.
        """
        if self._append(input_ids, position_ids):
            self._caches = [
                new_cache(c.model) if (self.use_cache and c.may_cache) else None for c in self.calls
            ]
        self._mask = attention_mask
        out = []
        for j, call in enumerate(self.calls):
            logits, self._caches[j] = self._forward(
                call, input_ids, attention_mask, position_ids, self._caches[j], last_only
            )
            out.append(logits)
        return out

    def has_sliding_window(self) -> bool:
        return any(has_sliding_window(c.model) for c in self.calls if c.may_cache)

    @torch.no_grad()
    def teacher_forced(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        out = []
        for call in self.calls:
            logits, _ = call(input_ids, attention_mask, position_ids, None, last_only=False)
            self.forward_passes += 1
            out.append(logits)
        return out
