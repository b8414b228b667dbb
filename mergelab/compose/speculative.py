"""Speculative composition: a cheap draft proposes tokens, the composition verifies them — exactly.

A composition of a base and ``k`` experts costs ``k + 1`` forward passes per token. The
task-arithmetic merge ``θ_b + Σ_i w_i (θ_i − θ_b)`` is one model that approximates the composition,
so let it *draft* and let the composition *verify* (speculative decoding: Leviathan et al. 2023,
Chen et al. 2023)::

    composed = ComposedDecoder(base, [math, code], tokenizer)
    fast = SpeculativeDecoder(composed)                      # draft: the task-arithmetic merge
    fast.generate(prompts, GenerationSettings(max_new_tokens=256))   # == composed.generate(...)

One block, for a batch of ``B`` rows and a block length ``γ``:

1. The draft proposes ``d_1 … d_γ``, one cached forward each: its argmax (greedy), or a sample of
   its distribution ``q`` warped exactly as plain sampling warps (temperature, top-k, top-p).
2. Every model of the composition scores ``[t, d_1 … d_γ]`` in **one** forward with its KV cache
   (``t``: the last decided token, not yet in the caches; LoRA experts: one batched forward).
   :meth:`~mergelab.compose.decoding.DecodingCandidate.compose` turns that into the composed
   log-probs ``p̂_0 … p̂_γ`` — weights, every :class:`Composition`, EOS policies and token masks
   included, by the same code as plain decoding.
3. Greedy: accept ``d_i`` while ``argmax p̂_{i−1} = d_i``; the first mismatch is replaced by the
   composition's argmax. Sampling: with ``p`` the *warped* composed distribution, accept ``d_i``
   with probability ``min(1, p(d_i) / q(d_i))``; at the first rejection draw from the normalised
   residual ``max(0, p − q)``. If all ``γ`` are accepted, one more token comes from ``p_γ``. Each
   token is then distributed exactly as ``p`` given its prefix, whatever the draft proposes — a
   bad draft only costs time.
4. Rollback: the caches drop the slots past each row's first rejection (``DynamicCache.crop``).
   Rows of a batch accept different numbers of tokens but a cache has one length: it is cropped to
   the longest row, and in shorter rows the rejected slots stay behind as *holes* — attention-mask
   0, never attended to, not counted in the position ids (``cumsum(mask) − 1``, as for left
   padding). At batch 1 there are never holes. Models with sliding-window layers (whose window
   counts cache slots, holes included) are therefore decoded one prompt at a time.

γ is fixed, or adaptive (default). Adaptive, each block chooses γ in ``0 … max_gamma`` from the
running per-token acceptance rate α of the drafts and the costs of a block: ``P``, one plain
composition step, and the seconds of a block of γ drafts — measured for every γ used so far, else
``P + γ·D`` with ``D`` what one drafted token added to the blocks measured (a forward's cost is not
linear in its width: on a CPU verifying 3 tokens can cost more than 5). A block of γ decides
``E_γ = (1 − α^{γ+1}) / (1 − α)`` tokens in expectation (Leviathan et al. 2023, §3.3); the γ of
most tokens per second is used when it beats plain steps (``1 / P``) by 5 %, otherwise the block is
**γ = 0: a plain composition step**, exactly plain decoding's (the draft does not run; it catches
up on the decided tokens in one forward when drafting resumes, and a batch that starts in plain
steps feeds the draft its prompt only then). Plain steps run as plain decoding's loop, and the
first token of a batch comes from the prompt's forward, as in plain decoding. While plain, a probe
block of one draft after 8, 16, 32, … up to 512 plain steps (each failed probe doubles the wait:
the draft's catch-up on the plain steps is most of a probe's cost) measures the acceptance again;
an accepted probe brings drafting back on trial (its blocks re-time the costs; drafting that does
not last 8 blocks doubles the wait too), so decoding returns to drafting when it would pay. With the default ``cost_ratio=None`` the costs are measured while decoding (CPU seconds
on a CPU, wall seconds on a GPU: the machine decides), and a decoder keeps α, the costs, γ and
the probes' wait from one batch (and call) to the next, as if they were one long generation; a
number fixes ``P = cost_ratio``, ``D = 1`` and every call starts afresh (then γ depends only on
the call's past acceptances and sampled draws are reproducible for a seed).

Greedy output is token-identical to the composition's (up to float ties: a block forward sums in a
different order than one-token steps), whatever γ each block takes. Sampled output follows the
composition's distribution (γ depends only on what came before a block, never on its draws) but
draws other random numbers than plain sampling, so it is not the same sample for the same seed;
for a given seed it is reproducible when γ is fixed or the costs are (``cost_ratio``), and
independent of the batch when γ is fixed (adaptive γ is shared by the rows of a batch). ``score`` and ``token_logprobs`` are the composition's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..candidate import Candidate, Generation, GenerationSettings
from .decoding import (
    DecodingCandidate,
    RowOutputs,
    component_logprobs_of,
    left_pad,
    sample_tokens,
    warp_logprobs,
)
from .vocab import check_same_tokenizer

DEFAULT_GAMMA = 4
DEFAULT_MAX_GAMMA = 8
_DECAY = 0.8  # the acceptance rate that adapts γ weighs the last ~5 blocks most
_PRIOR = (1.6, 0.4)  # pseudo-counts (accepted, rejected) of that rate: 0.8 before any block
DRAFT_MARGIN = 0.05  # draft only when blocks are expected 5 % faster than plain steps
_PROBE_GAMMA = 1  # drafts in a probe block while plain steps are the faster
_PROBE_EVERY = (8, 512)  # plain steps before a probe: 8, doubling after each failed probe, to 512
_STALE_AFTER = 8  # plain steps that age the acceptance counts as much as one drafted block does
_PAYING_RUN = 8  # drafted blocks in a row after a probe before drafting counts as paying again
_REMEASURE_EVERY = 32  # drafted blocks between two plain steps that re-measure P
_EMA_WEIGHT = 0.3  # of the newest timing in the running P and D


# ---------------------------------------------------------------------------- the default draft


def task_arithmetic_draft(composed: DecodingCandidate) -> DecodingCandidate:
    """The weight-space twin of a composition, as a one-model candidate (the default draft).

    With net coefficients ``c_j`` of the formula (:meth:`Composition.coefficients`) the draft's
    weights are ``Σ_j c_j θ_j / Σ_j c_j``; for the paper's rule ``base + Σ_i w_i (expert_i − base)``
    that is task arithmetic with weights ``w_i`` and λ = 1 —
    ``merge_models("task_arithmetic", base, experts, weights=w)``. For LoRA experts it is the
    task-arithmetic merge of the adapters folded into a copy of the base. Components of different
    shapes (proxy-tuning with a large and a small model) have no weight-space twin: pass a draft.
    """
    from mergelab.merge import merge_models
    from mergelab.model_candidate import ModelCandidate

    from .lora import LoraRunner

    composition = composed.composition
    coefficients = composition.coefficients()
    total = sum(coefficients.values())
    if total <= 0:
        raise ValueError(
            f"{composition}: coefficients sum to {total:g}, no weight average; pass draft="
        )
    names = list(composed.runner.names)
    weights = [coefficients[n] / total for n in names[1:]]
    runner = composed.runner
    if isinstance(runner, LoraRunner):
        model = runner.merged_model(weights)
    elif len(names) == 1:
        model = runner.models[names[0]]
    else:
        try:
            model = merge_models(
                "task_arithmetic",
                runner.models[names[0]],
                [runner.models[n] for n in names[1:]],
                weights=weights,
            )
        except Exception as exc:  # different architectures or shapes
            raise ValueError(
                f"no task-arithmetic draft for {composition} ({exc}); pass draft= explicitly"
            ) from exc
    return ModelCandidate(
        model,
        composed.tokenizer,
        name=f"task_arithmetic[{composition}]",
        eos_token_ids=composed.eos_token_ids,
    )


# ---------------------------------------------------------------------------- caches per row


class _CacheTrack:
    """A runner's caches plus the attention mask over their slots; rows roll back separately.

    ``keep(slots)`` keeps the first ``slots[r]`` slots of row ``r``: the caches are cropped to the
    longest row and the rest of shorter rows become holes (mask 0).
    """

    def __init__(self, runner: Any, batch: int, device: torch.device):
        self.runner = runner
        self.mask = torch.zeros((batch, 0), dtype=torch.long, device=device)

    @property
    def slots(self) -> int:
        return self.mask.shape[1]

    def feed(
        self, tokens: torch.Tensor, valid: torch.Tensor, last_only: bool = False
    ) -> list[torch.Tensor] | None:
        """Append ``tokens [B, T]`` (``valid`` 0 = a hole); per component logits ``[B, T, V]``."""
        if tokens.shape[1] == 0:
            return None
        valid = valid.long()
        positions = (self.mask.sum(-1, keepdim=True) + valid.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, valid], dim=1)
        return self.runner.extend(tokens, self.mask, positions, last_only)

    def keep(self, slots: torch.Tensor) -> None:
        longest = int(slots.max())
        index = torch.arange(self.slots, device=self.mask.device)
        mask = self.mask.masked_fill(index >= slots.to(self.mask.device)[:, None], 0)
        self.runner.rollback(self.slots - longest)
        self.mask = mask[:, :longest]


# ---------------------------------------------------------------------------- drafts

# choose(log-probs [B, V], position in the block) -> (tokens [B], warped draft probabilities
# [B, V], or None when greedy)
Chooser = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


class _CachedDraft:
    """A draft that is a :class:`DecodingCandidate` (a model, a merge, even a composition).

    ``todo[r]`` are the tokens of row ``r`` decided but not yet in the draft's caches: the last
    decided token, and after a fully accepted block also ``d_γ`` (never fed to the draft).
    """

    def __init__(
        self,
        candidate: DecodingCandidate,
        batch: int,
        pad_id: int,
        device: torch.device,
        settings: GenerationSettings,
    ):
        self.candidate = candidate
        self.eos_ids = candidate.call_eos_ids(settings)  # the call's EOS ids reach its policy
        self.track = _CacheTrack(candidate.runner, batch, device)
        self.pad_id, self.device = pad_id, device
        self.todo: list[list[int]] = [[] for _ in range(batch)]
        self._start = 0
        self._prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    def session(self):
        return self.candidate.runner.session()

    @property
    def forward_passes(self) -> int:
        return self.candidate.runner.forward_passes

    @property
    def prompt_pending(self) -> bool:
        return self._prefix is not None

    def prefill(
        self, prefix: torch.Tensor, prefix_mask: torch.Tensor, last: list[int], now: bool
    ) -> None:
        """``now=False``: the prompt waits for the first proposal (a batch decoded in plain steps
        alone never runs the draft)."""
        self._prefix = (prefix, prefix_mask)
        self.todo = [[t] for t in last]
        if now:
            self.track.feed(prefix, prefix_mask, last_only=True)
            self._prefix = None

    def _lp(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return self.candidate.compose([z[:, -1] for z in logits], eos_ids=self.eos_ids)

    def propose(self, gamma: int, choose: Chooser) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids, valid = left_pad(self.todo, self.pad_id, self.device)
        if self._prefix is not None:  # the prompt and what was decided since, in one forward
            prefix, prefix_mask = self._prefix
            ids = torch.cat([prefix, ids], dim=1)
            valid = torch.cat([prefix_mask.to(valid.dtype), valid], dim=1)
            self._prefix = None
        self._start = self.track.slots + ids.shape[1]
        lp = self._lp(self.track.feed(ids, valid, last_only=True))
        drafts, qs = [], []
        for i in range(gamma):
            if i:
                prev = drafts[-1].unsqueeze(-1)
                lp = self._lp(self.track.feed(prev, torch.ones_like(prev), last_only=True))
            token, q = choose(lp, i)
            drafts.append(token)
            qs.append(q)
        return torch.stack(drafts, dim=1), qs

    def defer(self, decided: list[list[int]]) -> None:
        """Tokens decided by plain steps (each row's): they wait with the others until the next
        proposal feeds them all in one forward."""
        self.todo = [t + d for t, d in zip(self.todo, decided)]

    def commit(self, accepted: list[int], drafts: list[list[int]], final: list[int]) -> None:
        gamma = len(drafts[0])
        # Fed in this block: todo, then d_1 … d_{γ−1}. Keep what was accepted.
        keep = [self._start + min(n, gamma - 1) for n in accepted]
        self.track.keep(torch.tensor(keep))
        self.todo = [[d[-1], f] if n == gamma else [f] for n, d, f in zip(accepted, drafts, final)]


class _TeacherForcedDraft:
    """Any :class:`~mergelab.candidate.Candidate` as a draft: ``token_logprobs`` of the whole
    prefix at every drafted position (no cache: slow, but needs nothing but the protocol)."""

    def __init__(
        self,
        candidate: Candidate,
        batch: int,
        pad_id: int,
        device: torch.device,
        settings: GenerationSettings,
    ):
        del settings  # the candidate's own token_logprobs decide its EOS
        self.candidate = candidate
        self.pad_id, self.device = pad_id, device
        self.sequences: list[list[int]] = [[] for _ in range(batch)]
        self.forward_passes = 0

    prompt_pending = False  # nothing is cached

    def session(self):
        return contextlib.nullcontext()

    def prefill(
        self, prefix: torch.Tensor, prefix_mask: torch.Tensor, last: list[int], now: bool
    ) -> None:
        self.sequences = [
            [int(t) for t, m in zip(row, mask) if m] + [token]
            for row, mask, token in zip(prefix.tolist(), prefix_mask.tolist(), last)
        ]

    def propose(self, gamma: int, choose: Chooser) -> tuple[torch.Tensor, list[torch.Tensor]]:
        drafted: list[list[int]] = [[] for _ in self.sequences]
        tokens, qs = [], []
        for i in range(gamma):
            ids, mask = left_pad(
                [s + d for s, d in zip(self.sequences, drafted)], self.pad_id, self.device
            )
            lp = self.candidate.token_logprobs(ids, mask)[:, -1].float()
            self.forward_passes += 1
            token, q = choose(lp, i)
            for row, t in enumerate(token.tolist()):
                drafted[row].append(t)
            tokens.append(token)
            qs.append(q)
        return torch.stack(tokens, dim=1), qs

    def defer(self, decided: list[list[int]]) -> None:
        for row, d in enumerate(decided):
            self.sequences[row] += d

    def commit(self, accepted: list[int], drafts: list[list[int]], final: list[int]) -> None:
        for row, (n, d, f) in enumerate(zip(accepted, drafts, final)):
            self.sequences[row] += d[:n] + [f]


# ---------------------------------------------------------------------------- block length


def expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens a block of ``gamma`` drafts decides in expectation, ``(1 − α^{γ+1}) / (1 − α)``."""
    a = min(max(acceptance, 0.0), 1.0)
    return gamma + 1.0 if a >= 1.0 else (1.0 - a ** (gamma + 1)) / (1.0 - a)


def best_gamma(acceptance: float, cost_ratio: float, max_gamma: int) -> int:
    """The γ in ``1 … max_gamma`` maximising expected decided tokens per unit of work.

    A block costs ``γ`` draft steps (1 each) and one verification (``cost_ratio``) and decides
    ``(1 − α^{γ+1}) / (1 − α)`` tokens in expectation at per-token acceptance ``α``.
    """
    a = min(max(acceptance, 0.0), 1.0)

    def tokens(g: int) -> float:
        return g + 1.0 if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)

    return max(range(1, max_gamma + 1), key=lambda g: tokens(g) / (g + cost_ratio))


def worth_drafting(gamma: int, acceptance: float, cost_ratio: float) -> bool:
    """Whether blocks of ``gamma`` drafts beat plain steps by :data:`DRAFT_MARGIN` in expected
    decided tokens per unit of work, one plain step costing ``cost_ratio`` draft tokens."""
    a = min(max(acceptance, 0.0), 1.0)
    tokens = gamma + 1.0 if a >= 1.0 else (1.0 - a ** (gamma + 1)) / (1.0 - a)
    return tokens / (gamma + cost_ratio) > (1.0 + DRAFT_MARGIN) / cost_ratio


class _Schedule:
    """The γ of each block: drafts while they pay, plain steps (γ = 0) otherwise.

    Running per-token acceptance (decayed counts of accepted and rejected drafts) and, unless
    ``cost_ratio`` fixes them, the measured seconds of a plain step (``P``) and of one drafted
    token (``D``: a block's seconds less ``P``, per draft). With measured costs a decoder keeps
    its schedule from one batch to the next, as if its batches were one
    long generation: a new batch starts where the last one stopped — drafting at the learnt γ, or
    in plain steps with the probes' wait where it was — instead of learning everything again.
    """

    def __init__(self, gamma: int, adaptive: bool, max_gamma: int, cost_ratio: float | None):
        self.adaptive, self.max_gamma, self.cost_ratio = adaptive, max_gamma, cost_ratio
        self.accepted = self.rejected = 0.0
        self.plain_seconds: float | None = None  # P
        self.token_seconds: float | None = None  # D
        self.block_seconds: dict[int, float] = {}  # γ → seconds of a block of γ drafts
        self.best = gamma  # the block length that maximises tokens per unit of work (≥ 1)
        self.initial_gamma = gamma
        # Measured costs: the first block is a plain step, so P is known from the start.
        self.gamma = 0 if adaptive and cost_ratio is None else gamma
        self.plain_run = 0  # plain steps since the last drafted block
        self.probe_every = _PROBE_EVERY[0]
        self.probing = False  # the block under way is a probe
        self.trial: int | None = None  # drafted blocks since a probe brought drafting back
        self.blocks_since_plain = 0
        self.drafted_last = False  # the last block drafted: the draft is (nearly) in sync
        self.waiting = False  # the last decision: plain steps are the faster (probes aside)

    @property
    def drafts_soon(self) -> bool:
        """The next block drafts, or the one after it will (to measure D)."""
        return self.gamma > 0 or (self.adaptive and self.ratio() is None)

    def plain_steps(self) -> int:
        """How many plain steps to take before the schedule decides again (≥ 1; when γ = 0):
        up to the next probe while plain steps are the faster, else one (the first block, the
        plain step that keeps ``P`` current). Nothing but a probe can bring drafting back
        while α is not measured, so the steps in between need no decision of their own."""
        if self.adaptive and self.ratio() is not None and self.waiting:
            return max(1, self.probe_every - self.plain_run)
        return 1

    def ratio(self) -> float | None:
        """One plain step's cost in drafted tokens, ``P / D`` (None: not measured yet)."""
        if self.cost_ratio is not None:
            return self.cost_ratio
        if self.plain_seconds is None or self.token_seconds is None:
            return None
        return self.plain_seconds / max(self.token_seconds, 0.02 * self.plain_seconds)

    def block_cost(self, gamma: int) -> float:
        """Seconds of a block of ``gamma`` drafts: measured for the γ used so far, else
        ``P + γ·D`` (a forward's cost is not linear in its width: on a CPU, verifying 3 tokens
        can cost more than 5 do, so each γ's own blocks decide where they were timed)."""
        measured = self.block_seconds.get(gamma)
        if measured is not None:
            return measured
        return self.plain_seconds + gamma * max(self.token_seconds, 0.02 * self.plain_seconds)

    def _best_measured(self) -> tuple[int, bool]:
        """The γ of most expected tokens per second, and whether it beats plain steps (1 / P) by
        :data:`DRAFT_MARGIN`."""
        a = self.rate()
        speed = {
            g: expected_tokens(g, a) / self.block_cost(g) for g in range(1, self.max_gamma + 1)
        }
        best = max(speed, key=speed.__getitem__)
        return best, speed[best] > (1.0 + DRAFT_MARGIN) / self.plain_seconds

    def rate(self) -> float:
        # A weak prior (0.8) keeps one lucky or unlucky block from deciding alone.
        return (self.accepted + _PRIOR[0]) / (self.accepted + self.rejected + sum(_PRIOR))

    def update(
        self,
        gamma: int,
        accepted: int,
        rejected: int,
        seconds: float,
        prompt: bool = False,
        steps: int = 1,
    ) -> None:
        """After a block of ``gamma`` drafts that took ``seconds``, or (``gamma`` 0) ``steps``
        plain steps that took ``seconds`` together; ``prompt``: the block fed the draft its
        prompt (the first drafted block of a batch begun in plain steps)."""
        if not self.adaptive:
            return
        if gamma == 0:
            self.plain_seconds = _ema(self.plain_seconds, seconds / steps)
            self.plain_run += steps
            self.blocks_since_plain = 0
        else:
            # Counts age with every block. A block with no rejection after plain steps (a probe
            # whose draft was accepted) also ages them by the plain run (once per _STALE_AFTER
            # steps): the rejections of a stretch long gone say little about the text decoded
            # now, so drafting comes back at once when the drafts turn right (on trial: a false
            # return costs a block or two, and doubles the wait).
            stale = self.plain_run / _STALE_AFTER if rejected == 0 else 0.0
            decay = _DECAY ** (1.0 + stale)
            self.accepted = decay * self.accepted + accepted
            self.rejected = decay * self.rejected + rejected
            # After plain steps the draft first catches up on them (and, in a batch begun in
            # plain steps, on its prompt): not a cost of drafting (one plain step leaves it two
            # tokens behind, as a fully accepted block does).
            in_sync = (self.drafted_last or self.plain_run <= 1) and not prompt
            # A block cut short by the end of the generation is not timed: a short call's last
            # (or only) block would otherwise decide the costs of the γ chosen for the next.
            if in_sync and gamma == self.gamma and self.plain_seconds is not None:
                # The first block of a trial replaces the costs: they were timed long ago, or
                # badly (a decoder's first wide forward, new shapes, costs more than the next).
                fresh = self.trial == 0
                extra = max(seconds - self.plain_seconds, 0.0) / gamma
                self.token_seconds = extra if fresh else _ema(self.token_seconds, extra)
                if fresh:  # every γ's timing goes: P + γ·D from this block until re-timed
                    self.block_seconds = {}
                self.block_seconds[gamma] = _ema(self.block_seconds.get(gamma), seconds)
            self.plain_run = 0
            self.blocks_since_plain += 1
        self.drafted_last = gamma > 0
        ratio = self.ratio()
        if ratio is None:  # D not measured yet: a block of the initial γ measures it
            # (not a shorter one: the cost of a narrow verification says little of wider ones)
            self.gamma = self.best
            return
        if self.cost_ratio is not None:
            self.best = best_gamma(self.rate(), ratio, self.max_gamma)
            worth = worth_drafting(self.best, self.rate(), ratio)
        else:
            self.best, worth = self._best_measured()
        if self.probing and gamma > 0 and accepted == gamma:
            # A probe's draft accepted: draft again, on trial, whatever the costs say — its
            # blocks are timed, so costs timed long ago or badly cannot keep drafting away.
            worth = True
        self.waiting = not worth
        if worth:
            # Drafting that a probe brought back is on trial: the wait between probes returns
            # to its shortest only once it has lasted _PAYING_RUN blocks.
            gamma_next = self.best
            if self.probing:
                self.trial = 0
                # Not shorter than the initial γ: the trial's first block re-times the costs, and
                # a narrow verification says little of wider ones (see __init__'s first block).
                gamma_next = max(self.best, self.initial_gamma)
            elif self.trial is not None and gamma > 0:
                self.trial += 1
                if self.trial >= _PAYING_RUN:
                    self.trial, self.probe_every = None, _PROBE_EVERY[0]
            self.gamma, self.probing = gamma_next, False
            if self.cost_ratio is None and self.blocks_since_plain >= _REMEASURE_EVERY:
                self.gamma = 0  # one plain step now and then keeps P current
            return
        if self.probing or self.trial is not None:
            # A probe that did not pay, or drafting it brought back that did not last: wait
            # twice as long before the next one (at most _PROBE_EVERY[1] plain steps).
            self.probe_every = min(2 * self.probe_every, _PROBE_EVERY[1])
            self.trial = None
        self.probing = self.plain_run >= self.probe_every
        self.gamma = min(_PROBE_GAMMA, self.max_gamma) if self.probing else 0


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - _EMA_WEIGHT) * old + _EMA_WEIGHT * new


# ---------------------------------------------------------------------------- the candidate


class SpeculativeDecoder(DecodingCandidate):
    """A composition (any :class:`DecodingCandidate`) decoded speculatively; a Candidate itself.

    ``draft``: a Candidate proposing tokens — a :class:`DecodingCandidate` (ModelCandidate, a merge,
    a composition) runs with its own KV cache, any other Candidate through ``token_logprobs``;
    ``None`` or ``"ta"``: :func:`task_arithmetic_draft`. ``gamma``: drafted tokens per block (the
    first block's when ``adaptive``); ``max_gamma`` bounds adaptive γ; ``adaptive`` also falls
    back to plain composition steps while drafting does not pay (and probes to come back);
    ``cost_ratio``: one plain step's cost in drafted tokens, default measured while decoding
    (see the module docstring). The distribution, ``score`` and ``token_logprobs`` are the
    composition's.

    ``Generation.cost`` of each row: ``drafted_tokens``, ``accepted_tokens``,
    ``acceptance_rate`` (accepted / drafted), ``blocks`` (verifications the row took part in),
    ``plain_steps`` (those of them that were plain steps: nothing drafted),
    ``verify_forward_passes`` and ``draft_forward_passes`` (the batch's, divided evenly) and
    ``model_evaluations_per_token`` (both together per decoded position; plain composition: the
    number of models, or 1 on the LoRA fast path).
    """

    def __init__(
        self,
        composed: DecodingCandidate,
        draft: Candidate | str | None = None,
        *,
        gamma: int = DEFAULT_GAMMA,
        adaptive: bool = True,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        cost_ratio: float | None = None,
        name: str | None = None,
    ):
        if isinstance(composed, SpeculativeDecoder):
            composed = composed.composed
        if not isinstance(composed, DecodingCandidate):
            raise TypeError(f"speculative decoding needs a ComposedDecoder, got {type(composed)}")
        if not (isinstance(gamma, int) and gamma >= 1):
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        if not (isinstance(max_gamma, int) and max_gamma >= gamma):
            raise ValueError(f"max_gamma must be an integer >= gamma ({gamma}), got {max_gamma!r}")
        super().__init__(
            composed.runner,
            composed.composition,
            composed.tokenizer,
            name=name or f"speculative[{composed.name}]",
            eos_policy=composed.eos_policy,
            eos_token_ids=composed.eos_token_ids,
            token_masks=composed.token_masks,
            kind="SpeculativeDecoder",
        )
        self.composed = composed
        if draft is None or draft == "ta":
            draft = task_arithmetic_draft(composed)
        elif isinstance(draft, str):
            raise ValueError(f"draft must be a Candidate, None or 'ta', got {draft!r}")
        self.draft = draft
        self._check_draft(draft)
        self.gamma, self.adaptive, self.max_gamma = gamma, adaptive, max_gamma
        # None: plain steps and drafted tokens are timed while decoding (see the module docstring).
        if cost_ratio is not None and not (isinstance(cost_ratio, (int, float)) and cost_ratio > 0):
            raise ValueError(f"cost_ratio must be a number > 0 or None, got {cost_ratio!r}")
        self.cost_ratio = None if cost_ratio is None else float(cost_ratio)
        # Measured costs: acceptance, P, D and γ carry from one batch to the next (_schedule).
        self._carried_schedule: _Schedule | None = None
        # Sliding-window caches count slots, holes included: decode one prompt at a time.
        self._one_row_at_a_time = self.runner.has_sliding_window() or (
            self._cached_draft and draft.runner.has_sliding_window()
        )

    @property
    def _cached_draft(self) -> bool:
        return isinstance(self.draft, DecodingCandidate)

    def _check_draft(self, draft: Candidate) -> None:
        if not isinstance(draft, Candidate):
            raise TypeError(f"draft {type(draft).__name__} is not a Candidate")
        if draft.tokenizer is not self.tokenizer:
            check_same_tokenizer([self.tokenizer, draft.tokenizer], ["composition", "draft"])
        if isinstance(draft, DecodingCandidate):
            if draft.runner is self.runner:
                raise ValueError("the draft shares the composition's runner: pass another model")
            from .lora import LoraRunner

            if not isinstance(self.runner, LoraRunner):
                return
            # The LoRA fast path hooks the base model's layers while it decodes: a draft running
            # the same modules would get the adapters' deltas added to its rows.
            hooked = {id(m) for m in self.runner.models["base"].modules()}
            for model in draft.runner.models.values():
                if any(id(m) in hooked for m in model.modules()):
                    raise ValueError(
                        "the draft runs modules of the LoRA composition's base model; pass a "
                        "copy (copy.deepcopy) or the default task-arithmetic draft"
                    )

    # ---------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        if self._identity_cache is None:
            self._identity_cache = {
                "type": self.kind,
                "name": self.name,
                "composed": self.composed.describe(),
                "draft": self.draft.describe(),
                "gamma": self.gamma,
                "adaptive": self.adaptive,
                "max_gamma": self.max_gamma,
                "cost_ratio": self.cost_ratio,
            }
        return self._identity_cache

    def __repr__(self) -> str:
        return (
            f"SpeculativeDecoder(composition={self.composition}, draft={self.draft.name!r}, "
            f"gamma={self.gamma}, adaptive={self.adaptive})"
        )

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompts: Any, settings: GenerationSettings | Any | None = None, **kwargs: Any
    ) -> list[Generation]:
        """As :meth:`DecodingCandidate.generate` (settings, a ``GenerationConfig``, kwargs, id
        prompts); one prompt at a time for models with sliding-window layers."""
        if self._one_row_at_a_time:
            kwargs["batch_size"] = 1
        return super().generate(prompts, settings, **kwargs)

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[str],
        encoded: list[list[int]],
        indices: list[int],
        settings: GenerationSettings,
    ) -> list[Generation]:
        ids, mask = left_pad(encoded, self.pad_id, self.device)
        batch = len(prompts)
        generators = self._row_generators(indices, settings)
        sampling = settings.do_sample
        row_gamma = [0] * batch  # this block's drafts that row r may use (its own block length)

        def warp(lp: torch.Tensor) -> torch.Tensor:
            return warp_logprobs(lp, settings.temperature, settings.top_k, settings.top_p)

        def choose(lp: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            tokens = lp.argmax(dim=-1)
            if not sampling:
                return tokens, None
            scores = warp(lp)
            # Only rows whose block reaches position i draw a random number: a row's draws then
            # do not depend on how long its neighbours' blocks are.
            rows = [r for r in range(batch) if i < row_gamma[r]]
            if rows:
                gens = [generators[r] for r in rows] if generators is not None else None
                tokens[rows] = sample_tokens(scores[rows], gens)
            return tokens, torch.softmax(scores.float(), dim=-1)

        draft_class = _CachedDraft if self._cached_draft else _TeacherForcedDraft
        draft = draft_class(self.draft, batch, self.pad_id, self.device, settings)
        eos_ids = self.call_eos_ids(settings)
        verifier = _CacheTrack(self.runner, batch, self.device)
        schedule = self._schedule()
        # CPU: this process's CPU seconds, the work itself (the wall clock of a shared machine
        # counts the time other processes run); GPU: wall seconds (each block syncs).
        clock = time.perf_counter if self.device.type == "cuda" else time.process_time
        rows = RowOutputs(self, batch, settings)
        drafted, accepted, blocks, plain = [0] * batch, [0] * batch, [0] * batch, [0] * batch
        verify_before, draft_before = self.runner.forward_passes, draft.forward_passes
        started = time.perf_counter()
        with self.runner.session(), draft.session():
            # The first token comes from the prompt's forward, as in plain decoding (no block
            # drafts it); every block then feeds the verifier the last decided token first.
            comps = [z[:, -1] for z in verifier.feed(ids, mask, last_only=True)]
            lp = self.compose(comps, eos_ids=eos_ids)
            pending = self._decide(lp, settings, generators)
            if settings.max_new_tokens > 0:  # (not a block: plain decoding takes it too)
                rows.add_step(pending, lp, comps)
            # The draft's prompt waits while the batch starts in plain steps (a carried schedule).
            draft.prefill(ids, mask, pending.tolist(), now=schedule.drafts_soon)
            while not all(rows.done):
                block_started = clock()
                # A block decides up to γ + 1 tokens of a row: draft no further than its end.
                row_gamma = [
                    0 if rows.done[r] else max(0, min(schedule.gamma, rows.remaining(r) - 1))
                    for r in range(batch)
                ]
                gamma = max(row_gamma)
                if gamma == 0:  # plain composition steps, as plain decoding takes them
                    steps_before = list(rows.steps)
                    wanted = schedule.plain_steps() if schedule.gamma == 0 else 1
                    pending, decided = self._plain_steps(
                        verifier, pending, rows, settings, eos_ids, generators, wanted
                    )
                    draft.defer(decided)
                    for r in range(batch):
                        blocks[r] += rows.steps[r] - steps_before[r]
                        plain[r] += rows.steps[r] - steps_before[r]
                    steps = len(decided[0])
                    schedule.update(0, 0, 0, clock() - block_started, steps=steps)
                    continue
                prompt = draft.prompt_pending
                drafts, qs = draft.propose(gamma, choose)
                start = verifier.slots
                block = torch.cat([pending.unsqueeze(-1), drafts], dim=1)  # [B, γ + 1]
                comps = verifier.feed(block, torch.ones_like(block))
                lp = self.compose(comps, eos_ids=eos_ids)  # [B, γ + 1, V]
                limit = torch.tensor(row_gamma, device=lp.device)
                n, final = _verify(lp, drafts, qs, limit, warp if sampling else None, generators)
                # What each row decided: d_1 … d_n, then the final token; and their log-probs.
                decided = torch.cat([drafts, final.unsqueeze(-1)], dim=1)
                decided.scatter_(1, n.unsqueeze(-1), final.unsqueeze(-1))
                logprobs = lp.gather(-1, decided.unsqueeze(-1)).squeeze(-1).tolist()
                components = (
                    component_logprobs_of(comps, decided.unsqueeze(-1)).tolist()
                    if settings.return_component_logprobs
                    else None
                )
                n_list, decided_list = n.tolist(), decided.tolist()
                for r in range(batch):
                    if rows.done[r]:
                        continue
                    blocks[r] += 1
                    drafted[r] += row_gamma[r]
                    accepted[r] += n_list[r]
                    for i in range(n_list[r] + 1):
                        rows.add(
                            r,
                            decided_list[r][i],
                            logprobs[r][i],
                            components[r][i] if components else None,
                        )
                        if rows.done[r]:
                            break
                # Roll back: the verifier keeps t, d_1 … d_n; the final token is fed next block.
                verifier.keep(start + 1 + n)
                draft.commit(n_list, drafts.tolist(), final.tolist())
                pending = final
                used = [r for r in range(batch) if row_gamma[r]]
                schedule.update(
                    gamma,
                    sum(n_list[r] for r in used),
                    sum(n_list[r] < row_gamma[r] for r in used),
                    clock() - block_started,
                    prompt,
                )
        seconds = time.perf_counter() - started
        verify_passes = self.runner.forward_passes - verify_before
        draft_passes = draft.forward_passes - draft_before
        cost = [
            {
                "drafted_tokens": float(drafted[r]),
                "accepted_tokens": float(accepted[r]),
                "acceptance_rate": accepted[r] / drafted[r] if drafted[r] else 0.0,
                "blocks": float(blocks[r]),
                "plain_steps": float(plain[r]),
                "verify_forward_passes": verify_passes / batch,
                "draft_forward_passes": draft_passes / batch,
            }
            for r in range(batch)
        ]
        return rows.generations(prompts, verify_passes + draft_passes, seconds, cost)

    def _schedule(self) -> _Schedule:
        """This batch's schedule: with measured costs the decoder's own, kept from its last batch;
        a fixed γ or ``cost_ratio`` starts afresh (a call then depends on its inputs alone)."""
        if not self.adaptive or self.cost_ratio is not None:
            return _Schedule(self.gamma, self.adaptive, self.max_gamma, self.cost_ratio)
        if self._carried_schedule is None:
            self._carried_schedule = _Schedule(self.gamma, True, self.max_gamma, None)
        return self._carried_schedule

    @staticmethod
    def _decide(
        lp: torch.Tensor, settings: GenerationSettings, generators: Sequence[torch.Generator] | None
    ) -> torch.Tensor:
        """Plain decoding's choice from composed log-probs ``[B, V]``: the argmax, or one draw
        per row of the warped distribution."""
        if not settings.do_sample:
            return lp.argmax(dim=-1)
        warped = warp_logprobs(lp, settings.temperature, settings.top_k, settings.top_p)
        return sample_tokens(warped, generators)

    def _plain_steps(
        self,
        verifier: _CacheTrack,
        pending: torch.Tensor,
        rows: RowOutputs,
        settings: GenerationSettings,
        eos_ids: torch.Tensor,
        generators: Sequence[torch.Generator] | None,
        steps: int,
    ) -> tuple[torch.Tensor, list[list[int]]]:
        """Up to ``steps`` plain composition steps, until every row is done: plain decoding's
        loop (:meth:`DecodingCandidate._generate_batch`) — one cached forward per model, one
        draw per row when sampling, nothing else per step. ``pending [B]``, the last decided
        token, is fed first. Returns the last decided token ``[B]`` (to be fed next) and each
        row's decided tokens."""
        batch = pending.shape[0]
        mask = verifier.mask
        positions = mask.sum(-1, keepdim=True)  # the next slot's position: the row's tokens so far
        next_ids, decided = pending, []
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
            comps = self.runner.step(next_ids.unsqueeze(-1), mask, positions)
            lp = self.compose(comps, eos_ids=eos_ids)
            next_ids = self._decide(lp, settings, generators)
            rows.add_step(next_ids, lp, comps)
            decided.append(next_ids)
            if all(rows.done):
                break
            positions = positions + 1
        verifier.mask = mask
        return next_ids, torch.stack(decided, dim=1).tolist()


def _verify(
    lp: torch.Tensor,
    drafts: torch.Tensor,
    qs: list[torch.Tensor | None],
    limit: torch.Tensor,
    warp: Callable[[torch.Tensor], torch.Tensor] | None,
    generators: Sequence[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts per row ``n [B]`` and the token that follows them ``final [B]``.

    ``lp [B, γ+1, V]``: composed log-probs after the pending token and each draft;
    ``drafts [B, γ]``; ``qs[i] [B, V]``: the draft's warped probabilities (sampling, ``warp``
    given) or None (greedy); ``limit [B]``: row r uses only its first ``limit[r]`` drafts.
    """
    batch, gamma = drafts.shape
    rows = torch.arange(batch, device=lp.device)
    usable = torch.arange(gamma, device=lp.device) < limit.unsqueeze(-1)  # [B, γ]
    if warp is None:  # greedy: accept while the composition's argmax is the draft
        target = lp.argmax(dim=-1)  # [B, γ+1]
        n = ((target[:, :gamma] == drafts) & usable).long().cumprod(dim=-1).sum(dim=-1)
        return n, target[rows, n]
    p = torch.softmax(warp(lp).float(), dim=-1)  # what plain sampling samples from
    q = torch.zeros_like(p)  # no draft at a row's last position: its residual is p itself
    if gamma:
        q[:, :gamma] = torch.stack(qs, dim=1) * usable.unsqueeze(-1)
        p_d = p[:, :gamma].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = q[:, :gamma].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        u = _uniforms(limit.tolist(), gamma, generators, lp.device)
        # u·q < p accepts with probability min(1, p/q) (q > 0: the draft was drawn from q).
        n = ((u * q_d < p_d) & usable).long().cumprod(dim=-1).sum(dim=-1)
    else:
        n = torch.zeros(batch, dtype=torch.long, device=lp.device)
    p_n, q_n = p[rows, n], q[rows, n]
    # After a rejection: the residual max(0, p − q), renormalised by sample_tokens. If it is all
    # zero (p = q up to rounding, so rejection had probability ~0), p itself.
    residual = (p_n - q_n).clamp(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return n, sample_tokens(torch.log(torch.where(empty, p_n, residual)), generators)


def _uniforms(
    counts: list[int], width: int, generators: Sequence[torch.Generator] | None, device
) -> torch.Tensor:
    """Uniform draws ``[B, width]``: ``counts[r]`` from row r's generator (the global RNG if
    None), the rest 1 (never used)."""
    out = torch.ones(len(counts), width, device=device)
    for r, count in enumerate(counts):
        if count:
            g = generators[r] if generators is not None else None
            out[r, :count] = torch.rand(count, generator=g, device=device)
    return out
