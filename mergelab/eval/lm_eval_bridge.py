"""lm-evaluation-harness bridge: any :class:`~mergelab.candidate.Candidate` as an lm-eval model.

From Python (a model, a merge, a composition, a LoRA composition — any candidate)::

    import lm_eval
    from mergelab.eval.lm_eval_bridge import MergelabLM
    results = lm_eval.simple_evaluate(model=MergelabLM(candidate), tasks=["arc_easy"])

From the shell, with a spec file (:mod:`mergelab.eval.spec`) naming the candidate::

    mergelab-lm-eval --model mergelab --model_args spec=compose.yaml --tasks arc_easy
    python -m mergelab.eval.lm_eval_bridge --model mergelab --model_args spec=compose.yaml ...

lm-eval 0.4.x finds models only in its own registry, filled when a module defining them is
imported; it does not read entry points. ``mergelab-lm-eval`` (and ``python -m``) import this
module, which registers ``"mergelab"``, then run lm-eval's own command line unchanged; in your
own scripts, ``import mergelab.eval.lm_eval_bridge`` before calling lm-eval does the same.

What each request type runs on (``requests`` come from lm-eval; numbers are in nats):

* ``loglikelihood`` — lm-eval's own tokenisation (:class:`lm_eval.api.model.TemplateLM`: context
  and continuation encoded together, then split; an empty context is the BOS/EOS prefix token),
  then the candidate's teacher-forced ``token_logprobs`` on left-padded batches; ``is_greedy``
  is the per-token argmax of the candidate's own distribution. Sequences longer than
  ``max_length + 1`` lose tokens on the left, as in lm-eval's ``hf`` model.
* ``loglikelihood_rolling`` — lm-eval's disjoint rolling windows of ``max_length`` tokens, each
  scored as above, summed.
* ``generate_until`` — ``Candidate.generate``: ``until`` → stop strings (lm-eval adds the EOS
  text), ``max_gen_toks`` → ``max_new_tokens``, every other argument read as transformers reads
  a ``GenerationConfig`` (``do_sample``, ``temperature``, ``top_p``, ``top_k`` — 50 when sampling
  without it, as in the ``hf`` model —, ``repetition_penalty``, ``min_new_tokens``; others are
  refused by name); greedy when ``do_sample`` is false. Prompts longer than ``max_length`` minus
  the generation length keep their last tokens. The text is cut at the first stop string, as
  lm-eval's ``hf`` model cuts it. Sampling draws from mergelab's seeded per-prompt
  generators (``seed`` model argument, default 1234, or a ``seed`` generation argument), not
  from torch's global RNG, so sampled texts differ from the ``hf`` model's.

So for one model the log-likelihoods, greedy flags and greedy generations equal lm-eval's ``hf``
model on the same checkpoint (``tests/test_lm_eval_bridge.py`` checks it), and for a composition
they are the composition's: equal to ``Candidate.score`` wherever lm-eval's joint tokenisation
splits as the candidate's separate one does.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from mergelab.candidate import Candidate, GenerationSettings, generation_settings
from mergelab.compose.decoding import DecodingCandidate, left_pad
from mergelab.errors import UserInputError
from mergelab.progress import on_terminal, progress_bar

DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf model falls back to this too
DEFAULT_BATCH_SIZE = 8


@register_model("mergelab")
class MergelabLM(TemplateLM):
    """A candidate seen by lm-eval. Give ``candidate`` (Python) or ``spec`` (a spec file or model
    folder, :mod:`mergelab.eval.spec`; what ``--model_args spec=...`` passes).

    ``batch_size``: prompts / sequences per forward (lm-eval's ``auto`` means the default, 8).
    ``max_length``: context window in tokens (default: the smallest of the models' configured
    positions, as lm-eval's ``hf`` model reads them). ``max_gen_toks``: default generation length
    when a task gives none (lm-eval's default, 256). ``device``/``dtype``: for a spec.
    ``progress`` (Python only): False silences the request bars (:mod:`mergelab.progress`:
    tqdm's on a terminal, plain lines in a log).

    ``usage[(task name, doc_id)]`` is what each document's requests cost: ``generated_tokens``
    (``generate_until``), ``scored_tokens`` (continuation tokens of ``loglikelihood`` requests,
    every window of ``loglikelihood_rolling``), ``seconds`` and ``forward_calls`` (each batch's
    share, split evenly over the requests it served).
    """

    def __init__(
        self,
        candidate: Candidate | None = None,
        *,
        spec: str | os.PathLike | None = None,
        pretrained: str | os.PathLike | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 1234,
        device: str | None = None,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        max_batch_size: int | None = None,  # passed by lm-eval; mergelab batches are fixed
        progress: bool = True,
    ):
        super().__init__()
        if spec is not None and pretrained is not None:
            raise ModelArgsError("give spec= or pretrained= (the same thing), not both")
        spec = spec if spec is not None else pretrained
        if (candidate is None) == (spec is None):
            raise ValueError("give a candidate (Python) or spec=<spec file or model folder>")
        if candidate is None:
            from mergelab.eval.spec import build_candidate

            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's command line passes cuda:0 unless told otherwise (its hf model
                # falls back the same way).
                warnings.warn(
                    f"device {device} requested but CUDA is unavailable: using CPU", stacklevel=2
                )
                device = "cpu"
            dtype = None if str(dtype).lower() == "auto" else dtype  # hf's "auto": as stored
            candidate = build_candidate(
                str(spec), device=device, dtype=dtype, trust_remote_code=bool(trust_remote_code)
            )
        elif device is not None or dtype is not None:
            raise ValueError("device/dtype apply to a spec; move the candidate's models instead")
        self.candidate = candidate
        self.tokenizer = candidate.tokenizer
        self.batch_size = _batch_size(batch_size)
        self._max_length = max_length
        self._max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self._device = getattr(candidate, "device", None) or torch.device("cpu")
        self.progress = bool(progress)
        self.usage: dict[tuple[str | None, int | None], dict[str, float]] = {}
        self._owners: list[Any] | None = None  # the Instance of each request being scored
        self._bars: bool | None = None  # the caller's wish for bars, while lm-eval tokenises

    def terminal_bars(self, disable_tqdm: bool = False) -> bool:
        """Whether progress is drawn as tqdm's bars (on a terminal): where lm-eval's own bars
        ("Tokenizing inputs", "Building contexts") are shown too; in a log only mergelab's
        lines are."""
        return self.progress and not disable_tqdm and on_terminal()

    def _bar(self, total: int, desc: str, disable_tqdm: bool):
        enabled = self.progress and not disable_tqdm
        return progress_bar(total=total, desc=desc, unit="request", enabled=enabled)

    def _account(self, instance: Any, **amounts: float) -> None:
        if instance is None:
            return
        key = (getattr(instance, "task_name", None), getattr(instance, "doc_id", None))
        entry = self.usage.setdefault(
            key, {"generated_tokens": 0, "scored_tokens": 0, "seconds": 0.0, "forward_calls": 0.0}
        )
        for name, value in amounts.items():
            entry[name] += value

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config=None) -> MergelabLM:
        """lm-eval's ``--model_args`` (a dict) plus its own ``--batch_size``/``--device``,
        checked by :func:`model_arguments`."""
        return cls(**model_arguments(arg_dict, additional_config))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config=None) -> MergelabLM:
        """lm-eval's ``key=value,key2=value2`` model arguments (see :meth:`create_from_arg_obj`)."""
        args = lm_utils.simple_parse_args_string(arg_string)
        return cls(**model_arguments(args, additional_config))

    # ------------------------------------------------------------------ what lm-eval asks
    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = (getattr(self.candidate, "eos_token_ids", None) or [None])[0]
        return eos

    @property
    def prefix_token_id(self) -> int:
        # What an empty context is conditioned on: BOS, else EOS (lm-eval's hf model, and
        # Candidate.encode_prompt, do the same).
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        from lm_eval.models.utils import resolve_max_length

        configs = [getattr(m, "config", None) for m in _models(self.candidate)]
        lengths = [
            resolve_max_length(c, self.tokenizer, default=DEFAULT_MAX_LENGTH)
            for c in configs
            if c is not None
        ]
        return min(lengths) if lengths else DEFAULT_MAX_LENGTH

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results config: the candidate's identity (formula, checksums)."""
        return {"mergelab_candidate": self.candidate.describe()}

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw
    ) -> list[int]:
        """The tokenizer's ids; BOS is not added twice to a string that starts with it."""
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = getattr(self.tokenizer, "bos_token", None)
        if add_special_tokens is None and bos and string.startswith(bos):
            kwargs["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **kwargs))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's: each (context, continuation) tokenised, then :meth:`_loglikelihood_tokens`;
        each request's cost is kept for its document (``usage``)."""
        self._owners, self._bars = list(requests), not disable_tqdm
        try:
            return super().loglikelihood(
                requests, disable_tqdm=not self.terminal_bars(disable_tqdm)
            )
        finally:
            self._owners = self._bars = None

    @torch.no_grad()
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
    ) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), continuation is the greedy path)`` per request."""
        pad_id = _pad_id(self.candidate, self.tokenizer)
        # What each request feeds the model: left-truncated to the window, the last continuation
        # token never an input. Requests with the same input (a multiple-choice question whose
        # choices differ only in their last token) share one forward, as in lm-eval's hf model.
        users: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("lm-eval sent an empty context or continuation")
            key = tuple((context + continuation)[-(self.max_length + 1) :][:-1])
            users.setdefault(key, []).append(i)
        # Longest first: similar lengths share a batch (little padding), results keep input order.
        inputs = sorted(users, key=len, reverse=True)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        owners = self._owners if self._owners and len(self._owners) == len(requests) else None
        if self._bars is not None:  # called by loglikelihood, which silenced lm-eval's bar
            disable_tqdm = not self._bars
        bar = self._bar(len(requests), "loglikelihood (mergelab)", disable_tqdm)
        for start in range(0, len(inputs), self.batch_size):
            chunk = inputs[start : start + self.batch_size]
            started = time.perf_counter()
            ids, mask = left_pad([list(key) for key in chunk], pad_id, self.device)
            logprobs = self.candidate.token_logprobs(ids, mask).float()
            for row, key in enumerate(chunk):
                for i in users[key]:
                    continuation = requests[i][2]
                    n = len(continuation)
                    target = torch.tensor(continuation, device=logprobs.device)
                    scored = logprobs[row, -n:]  # position t predicts token t + 1
                    total = float(scored.gather(-1, target[:, None]).sum())
                    greedy = bool((scored.argmax(dim=-1) == target).all())
                    results[i] = (total, greedy)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                bar.update(len(users[key]))
            if owners is not None:
                served = [i for key in chunk for i in users[key]]
                share = (time.perf_counter() - started) / len(served)
                for i in served:
                    self._account(
                        owners[i],
                        scored_tokens=len(requests[i][2]),
                        seconds=share,
                        forward_calls=1 / len(served),
                    )
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each string, in disjoint windows of ``max_length`` tokens."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts, owners = [], []
        for req in requests:
            (string,) = req.args
            pairs = [
                lm_utils.make_disjoint_window(pair)
                for pair in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += [(None, context, continuation) for context, continuation in pairs]
            counts.append(len(pairs))
            owners += [req] * len(pairs)
        self._owners = owners
        try:
            scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        finally:
            self._owners = None
        totals, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def decoding_settings(self, gen_kwargs: dict[str, Any]) -> tuple[GenerationSettings, list]:
        """(settings, stop sequences) for one set of lm-eval generation arguments.

        lm-eval's names (``until``, ``max_gen_toks``) become stop strings and ``max_new_tokens``;
        the rest are transformers' generation arguments, read as a ``GenerationConfig`` is
        (:func:`mergelab.candidate.generation_settings`: sampling without ``top_k`` means top-k 50,
        as in the ``hf`` model), plus ``seed``. Anything else is refused by name.
        """
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new_tokens = int(kwargs.pop("max_gen_toks"))
        temperature = kwargs.pop("temperature", None)
        if kwargs.get("do_sample") and temperature:
            kwargs["temperature"] = float(temperature)
        settings = generation_settings(
            None,
            max_new_tokens=max_new_tokens,
            # The EOS text never appears in decoded text (special tokens are skipped): EOS
            # itself ends a row.
            stop_strings=[s for s in until if s and s != eos] or None,
            seed=int(kwargs.pop("seed", self.seed)),
            batch_size=self.batch_size,
            **kwargs,
        )
        return settings, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context, cut at the first stop sequence."""
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}  # one settings object per distinct gen_kwargs
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        results: list[str | None] = [None] * len(args)
        bar = self._bar(len(args), "generate_until (mergelab)", disable_tqdm)
        for indices in groups.values():
            settings, until = self.decoding_settings(args[indices[0]][1])
            room = self.max_length - settings.max_new_tokens
            if room <= 0:
                raise ValueError(
                    f"max_gen_toks {settings.max_new_tokens} leaves no room for a prompt in a "
                    f"context of {self.max_length} tokens"
                )
            prompts = self._fit_contexts([args[i][0] for i in indices], room)
            generations = self.candidate.generate(prompts, settings)
            for i, gen in zip(indices, generations):
                text = postprocess_generated_text(gen.text, until, None)
                results[i] = text
                self._account(
                    requests[i],
                    generated_tokens=len(gen.token_ids),
                    seconds=gen.seconds,
                    forward_calls=gen.forward_passes,
                )
                self.cache_hook.add_partial("generate_until", args[i], text)
            bar.update(len(indices))
        bar.close()
        return results  # type: ignore[return-value]

    def _fit_contexts(self, contexts: list[str], room: int) -> list[str] | list[list[int]]:
        """The contexts, left-truncated to ``room`` tokens as lm-eval's hf model truncates them:
        as strings when all fit, else as token ids (mergelab's candidates take ids; any other
        candidate gets the kept ids decoded back to text)."""
        encoded = [self.tok_encode(c) for c in contexts]
        if all(len(ids) <= room for ids in encoded):
            return contexts
        longest = max(len(ids) for ids in encoded)
        warnings.warn(
            f"prompts of up to {longest} tokens are cut to their last {room} (max_length "
            f"{self.max_length} minus the generation length)",
            stacklevel=3,
        )
        kept = [ids[-room:] for ids in encoded]
        if isinstance(self.candidate, DecodingCandidate):
            return kept
        return [self.tok_decode(ids, skip_special_tokens=False) for ids in kept]


def _batch_size(value: Any) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    return _whole_number("batch_size", value, 1)


class ModelArgsError(UserInputError):
    """A ``--model_args`` entry mergelab cannot use (the command exits 2 with this line)."""


# --model_args of `--model mergelab`: name -> what it means (the help text shows this table).
MODEL_ARGS = {
    "spec": "a candidate spec file (YAML: model, base + experts, or merge) or a model folder",
    "pretrained": "the same as spec= (the name lm-eval's hf model uses)",
    "dtype": "float32, bfloat16, float16, or auto (as the checkpoint is stored); default auto",
    "device": "cpu, cuda, cuda:1, ... (CUDA unavailable: cpu)",
    "batch_size": f"sequences per forward, or auto (= {DEFAULT_BATCH_SIZE}); wins over --batch_size",
    "max_batch_size": "accepted, as the hf model takes it; mergelab's batches are fixed",
    "max_length": "context window in tokens (default: the models' configured positions)",
    "max_gen_toks": "generation length when a task gives none (default 256)",
    "seed": "seed of sampled generations (default 1234)",
    "trust_remote_code": "true/false, as the hf model takes it: run a checkpoint's own code",
}
WHOLE_NUMBERS = {"max_batch_size": 1, "max_length": 1, "max_gen_toks": 1, "seed": 0}


def _whole_number(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ModelArgsError(f"model_args: {key} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ModelArgsError(f"model_args: {key} must be a whole number, got {value!r}") from None
    if number < minimum:
        raise ModelArgsError(f"model_args: {key} must be at least {minimum}, got {value!r}")
    return number


def model_arguments(
    args: dict[str, Any] | None, additional: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``--model_args`` of ``--model mergelab`` (parsed by lm-eval: a dict) checked and turned
    into :class:`MergelabLM`'s keyword arguments; a mistake is a :class:`ModelArgsError` naming
    the key. ``additional``: what lm-eval's own flags pass (``--batch_size``, ``--device``,
    ``max_batch_size``); a key given in ``model_args`` wins over them (lm-eval's ``hf`` model
    would refuse the pair)."""
    args = dict(args or {})
    unknown = sorted(str(k) for k in set(args) - set(MODEL_ARGS))
    if unknown:
        raise ModelArgsError(
            f"model_args: unknown key(s) {unknown}; --model mergelab takes "
            f"{', '.join(MODEL_ARGS)} (mergelab-lm-eval --help)"
        )
    for key, value in (additional or {}).items():
        if value is not None and key in MODEL_ARGS:
            args.setdefault(key, value)
    given = [k for k in ("spec", "pretrained") if args.get(k) not in (None, "")]
    if len(given) != 1:
        raise ModelArgsError(
            "model_args: give spec=<spec file or model folder> (or pretrained=<the same>), "
            f"exactly one; got {given or 'neither'}"
        )
    out: dict[str, Any] = {"spec": str(args.pop(given[0]))}
    args.pop("spec", None), args.pop("pretrained", None)
    if args.get("dtype") is not None and str(args["dtype"]).lower() != "auto":
        from mergelab.merge.config import parse_dtype

        try:
            parse_dtype(args["dtype"])
        except ValueError as exc:
            raise ModelArgsError(f"model_args: {exc}") from None
    if "batch_size" in args:
        args["batch_size"] = _batch_size(args["batch_size"])
    for key, minimum in WHOLE_NUMBERS.items():
        if args.get(key) is not None:
            args[key] = _whole_number(key, args[key], minimum)
    if "trust_remote_code" in args:
        value = args["trust_remote_code"]
        text = str(value).lower()
        if text not in ("true", "false", "1", "0"):
            raise ModelArgsError(
                f"model_args: trust_remote_code must be true or false, got {value!r}"
            )
        args["trust_remote_code"] = text in ("true", "1")
    if args.get("device") is not None:
        args["device"] = str(args["device"])
    return {**out, **args}


def _pad_id(candidate: Any, tokenizer: Any) -> int:
    for value in (getattr(candidate, "pad_id", None), getattr(tokenizer, "pad_token_id", None)):
        if value is not None:
            return int(value)
    return 0  # any id: padded positions are masked out


def _models(candidate: Any) -> list[Any]:
    """The transformers models inside a candidate (for their configured context length)."""
    runner = getattr(candidate, "runner", None)
    if runner is not None and hasattr(runner, "models"):
        return list(runner.models.values())
    model = getattr(candidate, "model", None)
    return [model] if model is not None else []


HELP = """\
mergelab-lm-eval: lm-evaluation-harness's command line, with mergelab's candidates as
--model mergelab (a model, a weight merge made in memory, or a logit composition).

  mergelab-lm-eval --model mergelab --model_args spec=compose.yaml --tasks arc_easy
  mergelab-lm-eval run --model mergelab --model_args pretrained=models/merged \\
      dtype=bfloat16 batch_size=16 --tasks hellaswag

--model_args for --model mergelab (lm-eval's key=value form, comma- or space-separated):
{table}
A spec file is YAML with one of `model: FOLDER`, `base: FOLDER` + `experts: [...]` (a logit
composition; `weights`, `eos_policy`, `lora`) or `merge: {{method, base, models, parameters}}`
(docs/evaluators.md). A mistake in model_args is one line and exit code 2.

lm-eval's own help follows.
"""


def help_text() -> str:
    width = max(map(len, MODEL_ARGS)) + 2
    return HELP.format(table="\n".join(f"  {k:<{width}}{v}" for k, v in MODEL_ARGS.items()))


def main(argv: Sequence[str] | None = None) -> None:
    """``mergelab-lm-eval``: lm-eval's command line, with ``--model mergelab`` registered.

    Before lm-eval loads any task, ``--model_args`` of ``--model mergelab`` are checked
    (:func:`model_arguments`) and the spec is read; a bad input, an environment fault or an
    interrupt is one line (exit 2, 1, 130; ``MERGELAB_DEBUG=1`` shows the traceback), as for
    ``mergelab``. ``--help`` starts with what ``--model mergelab`` takes."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from mergelab.errors import classify, exit_code, one_line

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(help_text())
    try:
        setup_logging()
        parser = HarnessCLI()
        args = parser.parse_args()
        if getattr(args, "model", None) == "mergelab":
            from mergelab.eval.spec import parse_candidate_spec

            checked = model_arguments(
                getattr(args, "model_args", None),
                {"batch_size": getattr(args, "batch_size", None)},
            )
            parse_candidate_spec(checked["spec"])  # a missing or bad spec: before any task
        parser.execute(args)
    except (Exception, KeyboardInterrupt) as exc:
        if classify(exc) == "bug" or os.environ.get("MERGELAB_DEBUG", "") not in ("", "0"):
            raise
        kind = "" if isinstance(exc, KeyboardInterrupt) else "error: "
        print(f"mergelab-lm-eval: {kind}{one_line(exc)}", file=sys.stderr)
        raise SystemExit(exit_code(exc)) from None


if __name__ == "__main__":
    main()
