r"""mergelab compose: decode from a logit composition of local checkpoints, or save it.

    mergelab compose --base base/ --expert math/ --expert code/ --prompt "2 + 2 =" \
        --max-new-tokens 32
    mergelab compose --base base/ --expert math-lora/ --expert code-lora/ --lora \
        --prompts-file prompts.jsonl --out generations.jsonl --eos-policy base
    mergelab compose --base base/ --expert math/ --expert code/ --save math-code/

Experts are model folders (or, with --lora, PEFT adapter folders of the base). Prompts come
from --prompt (repeatable) or --prompts-file: .jsonl (one object with a "prompt" field per
line), .json (a list of strings or of such objects) or plain text with one prompt per line, all
UTF-8. Without --out the generations are printed. --save writes the composition as a small
folder (the formula and each model's folder, no weights) that ComposedDecoder.from_pretrained,
mergelab eval run --model, mergelab compare and mergelab-lm-eval load again; with --save the
prompts are optional. Every input is checked before a model is loaded; --out may not be,
contain or sit inside an input, and --force replaces only a generations file or a composition
folder that mergelab wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..candidate import GenerationSettings
from ..inputs import check_model_folder, check_regular_file, read_config_bytes
from ..lora import is_lora_adapter
from .eos import EOS_POLICIES
from .formula import Composition


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compose",
        help="generate from a logit composition of a base and experts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", required=True, help="base model folder (with its tokenizer)")
    p.add_argument("--expert", action="append", required=True, help="expert folder (repeat)")
    p.add_argument("--expert-name", action="append", help="name per expert (default expert1..k)")
    p.add_argument("--weight", action="append", type=float, help="weight per expert (default 1)")
    p.add_argument(
        "--composition", help="JSON file with a Composition over 'base' and the expert names"
    )
    p.add_argument(
        "--lora", action="store_true", help="experts are PEFT LoRA adapters of the base (fast path)"
    )
    p.add_argument(
        "--eos-policy",
        default="plain",
        choices=EOS_POLICIES,
        help="whose end-of-sequence probability the composition uses: its own (plain, default), "
        "the base's (base), the largest or smallest over the models (max, min), or the most "
        "confident model's (most_confident)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="JSONL with a 'prompt' field, or one prompt per line")
    p.add_argument("--out", help="write generations as JSONL here (atomically)")
    p.add_argument(
        "--save",
        metavar="DIR",
        help="write the composition to this folder (formula and model folders, no weights)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out or --save that mergelab wrote",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="most tokens generated per prompt (default 128)",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default 1)"
    )
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep this much mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeat)")
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="prompts decoded together (default 8)"
    )
    p.add_argument(
        "--component-logprobs", action="store_true", help="also record every model's log-probs"
    )
    p.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="speculative decoding: a draft proposes, the composition verifies (same output); "
        "falls back to plain steps while drafts do not pay. Default: on for greedy float32 "
        "decoding where the experts' task-arithmetic merge exists (the same tokens as plain "
        "composition), off for --sample (a seed's sample stays plain sampling's); "
        "--no-speculative: plain composition always",
    )
    p.add_argument(
        "--draft",
        help="with speculative decoding: 'ta' (the experts' task-arithmetic merge, default) or a "
        "model folder sharing the base's tokenizer",
    )
    p.add_argument(
        "--gamma", type=positive_int, help="with speculative decoding: drafted tokens per block (4)"
    )
    p.add_argument(
        "--fixed-gamma",
        action="store_true",
        help="with speculative decoding: do not adapt gamma (and never fall back to plain steps)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the models' weights dtype (default float32)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    from ..plugins import add_plugin_argument

    add_plugin_argument(p)
    p.set_defaults(func=run)
    return p


def positive_int(text: str) -> int:
    """argparse type: a whole number ≥ 1 (a count of tokens, items or prompts per batch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


MAX_PROMPTS_BYTES = 256 * 2**20


def read_utf8(path: Path, what: str, max_bytes: int = MAX_PROMPTS_BYTES) -> str:
    """The text of ``path`` (a regular file of at most ``max_bytes``); a file that is not UTF-8
    is an error naming the file and the byte."""
    raw = read_config_bytes(path, what, max_bytes=max_bytes)
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{what} {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from ``.jsonl`` (objects with a "prompt" field), ``.json`` (a list of strings or
    of such objects) or plain text (one per non-empty line). Errors name the file and line."""
    path = Path(path)
    text = read_utf8(path, "prompts file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompts.append(_prompt_from(_json(line, f"{path}:{n}"), f"{path}:{n}"))
    elif suffix == ".json":
        records = _json(text, str(path))
        if not isinstance(records, list):
            raise ValueError(
                f"{path}: a .json prompts file must hold a list of strings or of "
                f'{{"prompt": ...}} objects, not a {type(records).__name__}'
            )
        prompts = [_prompt_from(r, f"{path}: item {i}") for i, r in enumerate(records)]
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None


def _prompt_from(record, where: str) -> str:
    prompt = record.get("prompt") if isinstance(record, dict) else record
    if isinstance(record, dict) and "prompt" not in record:
        raise ValueError(f"{where}: no 'prompt' field")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: a prompt must be a string, not {type(prompt).__name__}")
    return prompt


def is_generations_file(path: Path) -> bool:
    """True for a JSONL file this command wrote: every record has its fields."""
    fields = {"candidate", "prompt", "text", "settings"}
    try:
        lines = [line for line in read_utf8(path, "file").splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]
    except (OSError, ValueError):
        return False
    return bool(records) and all(isinstance(r, dict) and fields <= r.keys() for r in records)


def check_inputs(args: argparse.Namespace) -> list[str]:
    """Every input path exists (before any tokenizer or model is loaded); returns them."""
    for path in [args.base, *args.expert]:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model folder {path} not found")
        check_model_folder(path)
    if is_lora_adapter(args.base):
        raise ValueError(
            f"--base {args.base} is a PEFT adapter folder (adapter_config.json); the base is a "
            "model folder, and adapters of it are experts with --lora"
        )
    for path in args.expert:
        if is_lora_adapter(path) != args.lora:
            raise ValueError(
                f"--expert {path} is a PEFT LoRA adapter folder (adapter_config.json); pass "
                "--lora to compose adapters of the base"
                if args.lora is False
                else f"--expert {path} is not a PEFT adapter folder (no adapter_config.json); "
                "with --lora every expert is a LoRA adapter of the base"
            )
    if args.lora:
        from .lora import check_adapters_fit

        check_adapters_fit(args.base, args.expert)  # before any model is loaded
    for path, what in [(args.composition, "composition file"), (args.prompts_file, "prompts file")]:
        if path is not None:
            check_regular_file(path, what)
    draft = _draft_folder(args)
    if draft is not None and not Path(draft).is_dir():
        raise FileNotFoundError(f"draft model folder {draft} not found")
    return [args.base, *args.expert, args.composition, args.prompts_file, draft]


def speculative_by_default(args: argparse.Namespace) -> bool:
    """Whether decoding is speculative when neither --speculative nor --no-speculative is given:
    for greedy decoding in float32, where its tokens are plain composition's (up to float ties,
    rarer in float32 than in half precision) and the adaptive rule keeps its cost at plain
    composition's when drafts do not pay; never for --sample (speculative sampling draws other
    random numbers: a seed's sample would change). ``build_decoder`` also keeps plain decoding
    where there is no task-arithmetic draft or a model has sliding-window layers."""
    return not args.sample and args.dtype == "float32"


def _speculative(args: argparse.Namespace) -> bool:
    return args.speculative if args.speculative is not None else speculative_by_default(args)


def _draft_folder(args: argparse.Namespace) -> str | None:
    """The --draft model folder (None for the default task-arithmetic draft); speculative-only
    flags without speculative decoding are refused."""
    if not _speculative(args):
        given = [f for f, v in [("--draft", args.draft), ("--gamma", args.gamma)] if v is not None]
        given += ["--fixed-gamma"] if args.fixed_gamma else []
        if given:
            why = "--no-speculative" if args.speculative is False else "--sample"
            if args.speculative is None and not args.sample:
                why = f"--dtype {args.dtype}"
            raise ValueError(
                f"{', '.join(given)}: only with speculative decoding (off with {why}; "
                "pass --speculative)"
            )
        return None
    return None if args.draft in (None, "ta") else args.draft


def build_decoder(args: argparse.Namespace, decode: bool = True):
    """The composition, decoded speculatively where asked or by default (``decode``: prompts
    will be decoded; without them no draft is built)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .composed import ComposedDecoder
    from .vocab import check_shipped_tokenizers

    dtype = getattr(torch, args.dtype)

    def load_model(path: str):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()

    check_inputs(args)
    names = args.expert_name or [f"expert{i + 1}" for i in range(len(args.expert))]
    if len(names) != len(args.expert):
        raise ValueError(f"{len(names)} --expert-name for {len(args.expert)} --expert")
    if args.weight is not None and len(args.weight) != len(args.expert):
        raise ValueError(f"{len(args.weight)} --weight for {len(args.expert)} --expert")
    if args.weight is not None:
        Composition.weighted("base", names, args.weight)  # refuses NaN/inf before any load
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    composition = None
    if args.composition:
        if args.weight is not None:
            raise ValueError("pass either --weight or --composition")
        path = Path(args.composition)
        text = read_utf8(path, "composition file")
        _json(text, str(path))  # a syntax error names the file
        composition = Composition.from_json(text)
    # Experts (and a draft) that ship a tokenizer must ship the base's.
    draft_folder = _draft_folder(args)
    check_shipped_tokenizers(
        tokenizer, args.base, [*args.expert, *([draft_folder] if draft_folder else [])]
    )
    base = load_model(args.base)
    common = dict(eos_policy=args.eos_policy, expert_names=names, composition=composition)
    if args.lora:
        decoder = ComposedDecoder.from_lora(
            base, list(args.expert), tokenizer, args.weight, **common
        )
    else:
        experts = [load_model(p) for p in args.expert]
        decoder = ComposedDecoder(base, experts, tokenizer, args.weight, **common)
    if not _speculative(args) or not decode:
        return decoder
    from mergelab.model_candidate import ModelCandidate

    from .speculative import SpeculativeDecoder

    draft = "ta"
    if draft_folder is not None:
        draft = ModelCandidate(load_model(draft_folder), tokenizer, name=draft_folder)
    options = dict(gamma=args.gamma or 4, adaptive=not args.fixed_gamma)
    if args.speculative:
        return SpeculativeDecoder(decoder, draft, **options)
    # The default: only where speculative decoding cannot lose. Sliding-window models decode
    # one prompt at a time; a composition without a weight-space twin has no default draft.
    if draft_folder is None and decoder.runner.has_sliding_window():
        return decoder
    try:
        # The composition's name: the records say which composition decoded, as without it.
        return SpeculativeDecoder(decoder, draft, name=decoder.name, **options)
    except ValueError:
        if draft_folder is not None:
            raise
        return decoder


def run(args: argparse.Namespace) -> int:
    from ..outputs import atomic_output_file, check_output_file, check_output_path
    from ..plugins import load_from_args

    load_from_args(args)  # a user's code, as for every subcommand (docs/guides/plugins.md)
    inputs = check_inputs(args)
    if not (args.prompt or args.prompts_file or args.save):
        raise ValueError("give --prompt or --prompts-file (or --save DIR to save the composition)")
    if args.out and not (args.prompt or args.prompts_file):
        raise ValueError("--out holds generations: give --prompt or --prompts-file")
    prompts = args.prompt or (read_prompts(args.prompts_file) if args.prompts_file else [])
    output = dict(force=args.force, inputs=inputs, written_by_mergelab=is_generations_file)
    if args.out:
        check_output_file(args.out, **output)  # fail before loading any model
    if args.save:
        check_output_path(args.save, force=args.force, inputs=inputs)
    decoder = build_decoder(args, decode=bool(prompts))
    if args.save:
        composed = getattr(decoder, "composed", decoder)  # speculative decoding decodes it
        composed.save_pretrained(args.save, force=args.force)
        print(f"saved the composition {composed.name} to {args.save}")
        if not prompts:
            return 0
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        batch_size=args.batch_size,
        return_component_logprobs=args.component_logprobs,
    )
    generations = decoder.generate(prompts, settings)
    if args.out:
        with atomic_output_file(args.out, **output) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                for g in generations:
                    record = {
                        "candidate": decoder.name,
                        **g.to_dict(),
                        "settings": settings.to_dict(),
                    }
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"wrote {len(generations)} generations of {decoder.name} to {args.out}")
    else:
        for g in generations:
            print(f"### {g.prompt}\n{g.text}\n[{g.finish_reason}, {len(g.token_ids)} tokens]")
    return 0
