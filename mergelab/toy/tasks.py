"""Toy string transformations and the two ways of posing them to a causal LM.

Skills
------
* :class:`LetterMap` — rewrite single letters (``A->B``), copy everything else. The identity map
  is the *background* (base) behaviour; A→B and C→D are the paper's experts.
* :class:`SpanSkill` — a letter function applied only inside a marked span ``<...>`` or
  ``(...)``: the span's stopping times τ1 (opening marker) and τ2 (closing marker) are decided
  by the prefix, so the skill is active only in [τ1, τ2] and the model equals the base elsewhere.

Two joint targets for a pair of letter maps (they differ only when the maps interact):

* ``parallel_target`` — each input letter is rewritten by the one map that touches it; this is
  what logit composition computes when the experts touch disjoint letters (undefined, ``None``,
  if two maps rewrite the same letter differently: A→B with A→C).
* ``LetterMap.chain`` — apply the maps one after another (A→B then B→C sends A to C).

Posing a transformation ``x -> y`` to a causal LM
--------------------------------------------------
* **aligned** (the authors' protocol; ``len(y) == len(x)``): the model reads ``x``; the logits at
  position ``t`` — which see only ``x[:t+1]`` — are trained to predict ``y[t]``. The model is
  used as a per-position classifier: ``token_logprobs(x)[:, t]`` is the distribution of ``y[t]``
  (not of ``x[t+1]``), and the prediction is the per-position argmax. No shift between inputs
  and labels.
* **generative** (how LLMs are used): the sequence is ``x [SEP] y [EOS]``; the usual next-token
  loss on the ``y [EOS]`` part only; at test time the model reads ``x [SEP]`` and generates
  greedily until EOS.

Both encoders return ``input_ids`` and ``labels`` with ``labels[:, t]`` = the token the logits
at position ``t`` are trained to predict (``-100`` = no loss), so one training loop serves both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .tokenizer import ALPHABET, LETTERS, encode

IGNORE = -100


def random_strings(
    n: int, length: int | tuple[int, int], rng: random.Random, alphabet: str = ALPHABET
) -> list[str]:
    """``n`` uniform random strings over ``alphabet``; ``length`` fixed or an inclusive range."""
    lo, hi = (length, length) if isinstance(length, int) else length
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length {length!r}: need 1 <= lo <= hi")
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@dataclass(frozen=True)
class LetterMap:
    """A per-character rewrite, e.g. ``LetterMap.parse("A->B")``; unmapped characters are copied."""

    pairs: tuple[tuple[str, str], ...] = ()
    name: str = "identity"

    @classmethod
    def parse(cls, spec: str) -> LetterMap:
        """``"A->B"`` or ``"A->B,C->D"``; ``""``/``"identity"`` is the copy map."""
        if spec in ("", "identity"):
            return cls()
        pairs = []
        for part in spec.split(","):
            src, sep, dst = part.strip().partition("->")
            if not sep or len(src) != 1 or len(dst) != 1 or not (src + dst).isupper():
                raise ValueError(f"bad letter map {part!r}; expected e.g. 'A->B'")
            pairs.append((src, dst))
        if len({s for s, _ in pairs}) != len(pairs):
            raise ValueError(f"letter map {spec!r} maps one letter twice")
        return cls(tuple(pairs), spec)

    @classmethod
    def permutation(cls, seed: int) -> LetterMap:
        """A fixed random permutation of A–Z (the 'shuffled base' of the failure study)."""
        perm = list(LETTERS)
        random.Random(seed).shuffle(perm)
        return cls(tuple(zip(LETTERS, perm)), f"shuffle{seed}")

    @property
    def table(self) -> dict[str, str]:
        return dict(self.pairs)

    def touches(self, ch: str) -> bool:
        return self.table.get(ch, ch) != ch

    def __call__(self, text: str) -> str:
        t = self.table
        return "".join(t.get(c, c) for c in text)

    @staticmethod
    def chain(maps: Sequence[LetterMap], text: str) -> str:
        """Apply ``maps`` one after another (sequential semantics)."""
        for m in maps:
            text = m(text)
        return text


def parallel_target(maps: Sequence[LetterMap], text: str) -> str | None:
    """Rewrite each character by the one map that changes it; ``None`` if two maps conflict."""
    out = []
    for c in text:
        changed = {m(c) for m in maps if m.touches(c)}
        if len(changed) > 1:
            return None
        out.append(changed.pop() if changed else c)
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Encoders: (x, y) string pairs -> input_ids / labels tensors


@dataclass(frozen=True)
class AlignedTask:
    """Authors' protocol: ``labels[:, t] = y[t]``, the logits at ``t`` see ``x[:t+1]``."""

    tokenizer: object

    def encode(
        self, inputs: Sequence[str], targets: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``input_ids, labels``: ``[N, T]`` long, right-padded (pad id / -100)."""
        pad = self.tokenizer.pad_token_id
        xs, ys = [], []
        for x, y in zip(inputs, targets, strict=True):
            if len(x) != len(y):
                raise ValueError(f"aligned task needs len(x) == len(y): {x!r} vs {y!r}")
            xs.append(encode(self.tokenizer, x))
            ys.append(encode(self.tokenizer, y))
        return _pad(xs, pad), _pad(ys, IGNORE)

    def prompts(self, inputs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids, attention_mask`` to feed ``Candidate.token_logprobs``."""
        ids = [encode(self.tokenizer, x) for x in inputs]
        input_ids = _pad(ids, self.tokenizer.pad_token_id)
        mask = _pad([[1] * len(i) for i in ids], 0)
        return input_ids, mask

    def decode_logprobs(self, logprobs: torch.Tensor, inputs: Sequence[str]) -> list[str]:
        """Per-position argmax of ``[N, T, V]`` log-probs, cut to each input's length."""
        ids = logprobs.argmax(-1).tolist()
        return [
            "".join(self.tokenizer.convert_ids_to_tokens(row[: len(x)]))
            for row, x in zip(ids, inputs)
        ]


@dataclass(frozen=True)
class GenerativeTask:
    """``x [SEP] y [EOS]``; next-token loss on ``y [EOS]``; prompt at test time is ``x [SEP]``."""

    tokenizer: object

    def encode(
        self, inputs: Sequence[str], targets: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer
        seqs, labs = [], []
        for x, y in zip(inputs, targets, strict=True):
            seq = encode(tok, x) + [tok.sep_token_id] + encode(tok, y) + [tok.eos_token_id]
            # logits at t predict seq[t+1]; only the answer part (after SEP) carries loss.
            lab = [IGNORE] * len(x) + seq[len(x) + 1 :] + [IGNORE]
            seqs.append(seq)
            labs.append(lab)
        return _pad(seqs, tok.pad_token_id), _pad(labs, IGNORE)

    def prompt(self, x: str) -> str:
        return x + self.tokenizer.sep_token


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Sequential skills with stopping times


def shift_letter(c: str) -> str:
    """Caesar shift by one (A→B, …, Z→A)."""
    return LETTERS[(LETTERS.index(c) + 1) % 26]


def mirror_letter(c: str) -> str:
    """Atbash mirror (A↔Z, B↔Y, …)."""
    return LETTERS[25 - LETTERS.index(c)]


@dataclass(frozen=True)
class SpanSkill:
    """A letter function active only between an opening and a closing marker."""

    name: str
    open: str
    close: str
    fn: Callable[[str], str]


SHIFT_SPAN = SpanSkill("shift<>", "<", ">", shift_letter)
MIRROR_SPAN = SpanSkill("mirror()", "(", ")", mirror_letter)
SPAN_MARKERS = "<>()"


@dataclass(frozen=True)
class SpanExample:
    """One span-task string: ``letters`` and, per skill, its span ``(start, end)`` (end exclusive)."""

    letters: str
    spans: tuple[tuple[int, int], ...]

    def render(self, skills: Sequence[SpanSkill], active: Sequence[SpanSkill]) -> str:
        """The marked string with every ``active`` skill applied inside its span (in skill order).

        ``render(skills, [])`` is the input (and the base's copy target). Markers are placed
        before the first / after the last letter of a span, openings and closings in skill order.
        """
        out = []
        for i, c in enumerate(self.letters):
            for sk, (s, _) in zip(skills, self.spans):
                if s == i:
                    out.append(sk.open)
            for sk, (s, e) in zip(skills, self.spans):
                if sk in active and s <= i < e:
                    c = sk.fn(c)
            out.append(c)
            for sk, (_, e) in zip(skills, self.spans):
                if e - 1 == i:
                    out.append(sk.close)
        return "".join(out)

    def overlap(self) -> int:
        """Number of letters inside every span at once."""
        lo = max(s for s, _ in self.spans)
        hi = min(e for _, e in self.spans)
        return max(0, hi - lo)


@dataclass(frozen=True)
class SpanSkillTask:
    """Strings of ``n_letters`` letters with one span per skill.

    ``sample_random`` places each span independently (lengths 1..``max_span``), so spans overlap
    sometimes: this is the training distribution of base and experts. ``sample_with_overlap``
    fixes both span lengths to ``span`` and their overlap to ``k`` letters (k = 0: adjacent,
    disjoint) — the test sweep.
    """

    skills: tuple[SpanSkill, ...] = (SHIFT_SPAN, MIRROR_SPAN)
    n_letters: int = 12
    max_span: int = 5

    def sample_random(self, n: int, rng: random.Random) -> list[SpanExample]:
        out = []
        for _ in range(n):
            letters = "".join(rng.choice(LETTERS) for _ in range(self.n_letters))
            spans = []
            for _sk in self.skills:
                w = rng.randint(1, self.max_span)
                s = rng.randint(0, self.n_letters - w)
                spans.append((s, s + w))
            out.append(SpanExample(letters, tuple(spans)))
        return out

    def sample_with_overlap(
        self, n: int, k: int, span: int, rng: random.Random
    ) -> list[SpanExample]:
        if len(self.skills) != 2:
            raise ValueError("the overlap sweep is defined for two skills")
        if not 0 <= k <= span or 2 * span - k > self.n_letters:
            raise ValueError(f"overlap {k} with span {span} does not fit {self.n_letters} letters")
        out = []
        for _ in range(n):
            letters = "".join(rng.choice(LETTERS) for _ in range(self.n_letters))
            s = rng.randint(0, self.n_letters - (2 * span - k))
            first, second = (s, s + span), (s + span - k, s + 2 * span - k)
            # Either skill may come first in the string.
            spans = (first, second) if rng.random() < 0.5 else (second, first)
            out.append(SpanExample(letters, spans))
        return out
