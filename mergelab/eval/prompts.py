"""Prompts per benchmark, following the paper's protocols (docs/composition.md §4):

* GSM8K: 8-shot chain of thought with the standard exemplars of Wei et al. (2022)
  (``data/gsm8k_cot_8shot.json``): ``Q: ...\\nA: ... The answer is N.``; stop at the next ``Q:``.
* MATH: few-shot (2 by default, as in the paper) with Minerva's exemplars
  (``data/math_4shot.json``), answers in ``\\boxed{}``; stop at the next ``Problem:``.
* Code: completion of the benchmark's prompt (HumanEval: the function stub; MBPP(+): the task
  text with its tests), cut at the usual stop sequences (a new top-level ``def``/``class``/
  ``if``/``print``, a comment line, a closing code fence).

With ``chat_template="auto"`` a tokenizer that has a chat template gets the prompt as one user
message (plus an optional system message) and the assistant turn opened; code prompts then ask
for a fenced code block and no code stop sequences apply (the fence is extracted instead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from mergelab.eval.benchmarks import Benchmark, Item

HUMANEVAL_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\n```")
MBPP_STOPS = ("\nclass ", "\nif __name__", "\nprint(", "\nassert ", '\n"""', "\n```")
GSM8K_STOPS = ("Q:", "</s>", "<|im_end|>", "\n\n\n")
MATH_STOPS = ("Problem:", "</s>", "<|im_end|>", "\n\n\n")
CODE_CHAT_INSTRUCTION = (
    "Complete the following Python code. Reply with the complete function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class PromptConfig:
    """How prompts are built. ``n_shots=None`` means the task's default (its ``shots``: GSM8K 8,
    MATH 2, code 0). ``exemplars`` replaces the task's few-shot examples (dicts with ``question``
    and ``answer`` for GSM8K-style tasks, ``problem`` and ``solution`` for MATH-style ones).
    ``chat_template``: ``"never"`` (plain text, the paper's protocol for base models),
    ``"auto"`` (use the tokenizer's template when it has one) or ``"always"`` (error without
    one). ``stop_strings=None`` means the defaults for the benchmark and style."""

    n_shots: int | None = None
    chat_template: str = "never"
    system_prompt: str | None = None
    exemplars: tuple[dict[str, str], ...] | None = None
    stop_strings: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.chat_template not in ("never", "auto", "always"):
            raise ValueError(
                f"chat_template must be 'never', 'auto' or 'always', got {self.chat_template!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_shots": self.n_shots,
            "chat_template": self.chat_template,
            "system_prompt": self.system_prompt,
            "exemplars": [dict(e) for e in self.exemplars] if self.exemplars else None,
            "stop_strings": list(self.stop_strings) if self.stop_strings is not None else None,
            "extra": self.extra,
        }


@cache
def load_exemplars(name: str) -> tuple[dict[str, str], ...]:
    """Exemplars shipped in ``mergelab/eval/data``: ``"gsm8k_cot_8shot"`` or ``"math_4shot"``."""
    text = resources.files("mergelab.eval").joinpath("data", f"{name}.json").read_text("utf-8")
    return tuple(json.loads(text)["exemplars"])


def shots(config: PromptConfig) -> list[dict[str, str]]:
    """The few-shot examples of a prompt: the first ``n_shots`` of ``exemplars`` (a task's
    builder gets ``config`` with both already filled in by :meth:`~mergelab.eval.Task.prompt_config`)."""
    return list((config.exemplars or ())[: config.n_shots or 0])


def gsm8k_prompt(question: str, config: PromptConfig = PromptConfig()) -> str:
    """``Q: …`` / ``A: …`` per shot, then the question (zero-shot: ``Q: question\\nA:``)."""
    examples = "".join(f"Q: {e['question']}\nA: {e['answer']}\n\n" for e in shots(config))
    return f"{examples}Q: {question}\nA:"


def math_prompt(problem: str, config: PromptConfig = PromptConfig()) -> str:
    examples = "".join(
        f"Problem:\n{e['problem']}\n\nSolution:\n{e['solution']}\n\n" for e in shots(config)
    )
    return f"{examples}Problem:\n{problem}\n\nSolution:\n"


def uses_chat_template(config: PromptConfig, tokenizer: Any) -> bool:
    has = getattr(tokenizer, "chat_template", None) is not None
    if config.chat_template == "always" and not has:
        raise ValueError("chat_template='always' but the tokenizer has no chat template")
    return config.chat_template != "never" and has


def build_prompt(
    item: Item, benchmark: Benchmark, config: PromptConfig = PromptConfig(), tokenizer: Any = None
) -> str:
    """The text given to the candidate for ``item``: the prompt of the benchmark's task, as one
    user turn of the tokenizer's chat template when ``config`` asks for it (code tasks then ask
    for a fenced code block)."""
    from mergelab.eval.tasks import get_task

    task = get_task(benchmark.task)
    chat = uses_chat_template(config, tokenizer)
    text = task.build_prompt(item, task.prompt_config(config))
    if not chat:
        return text
    if task.kind == "code":
        text = CODE_CHAT_INSTRUCTION.format(prompt=text)
    messages = []
    if config.system_prompt:
        messages.append({"role": "system", "content": config.system_prompt})
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def code_stop_strings(benchmark: Benchmark) -> tuple[str, ...]:
    """Plain-text code completion: stop at a new top-level block (HumanEval-style stubs) or, for
    MBPP-style task texts, also at the next test or docstring."""
    prompt_is_code = all(it.tests.prompt_is_code for it in benchmark.items if it.tests)
    return HUMANEVAL_STOPS if prompt_is_code else MBPP_STOPS


def stop_strings(
    benchmark: Benchmark, config: PromptConfig = PromptConfig(), tokenizer: Any = None
) -> tuple[str, ...]:
    """Stop sequences for ``benchmark`` under ``config`` (its task's, unless ``config`` gives
    them; none for code answered in a chat's fenced block)."""
    from mergelab.eval.tasks import get_task

    if config.stop_strings is not None:
        return tuple(config.stop_strings)
    task = get_task(benchmark.task)
    if task.kind == "code" and uses_chat_template(config, tokenizer):
        return ()
    return tuple(task.stop_strings(benchmark))
