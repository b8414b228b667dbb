"""mergekit's command line on ``mergelab merge``: ``mergekit-yaml config.yml OUT [flags]``.

``mergelab merge config.yml OUT`` and ``mergelab merge --config config.yml OUT`` read the output
folder from the command line as ``mergekit-yaml`` does (and so does ``mergelab merge --method
ties --model a/ --model b/ OUT``). mergekit's flags (mergekit 0.1.5,
``mergekit/options.py``) are accepted where mergelab does the same thing — some always do it,
so the flag changes nothing — and otherwise refused with one line that names mergelab's way
(exit code 2), never silently ignored:

===========================  =====================================================================
flag                         in mergelab
===========================  =====================================================================
--lazy-unpickle              always: safetensors are memory-mapped, read tensor by tensor
--copy-tokenizer             always: the base's tokenizer files are copied to the output
--trust-remote-code          nothing to trust: mergelab reads config.json and safetensors only
--clone-tensors              always: each output tensor is written from its own buffer
--write-model-card           always: README.md records the config and the inputs
--safe-serialization         always: the output is safetensors
--async-write                always: shards are written by a background thread
--random-seed N              --seed N
--quiet                      --no-progress
-j/--num-threads N           torch's threads, which mergelab's merge threads follow
--device cpu                 the only device: merges run on the CPU
--cuda, --device cuda, ...   refused: CPU only (streamed, compiled loops)
--low-cpu-memory, ...        refused, as --cuda (the GPU options)
--out-shard-size N           refused: --shard-size counts bytes, mergekit's flag parameters
--allow-crimes               refused: one architecture only (tensors matched by name and shape)
--unsafe-truncate-...        refused: --vocab-padding truncate, or tokenizer_source
--transformers-cache DIR     refused: set HF_HUB_CACHE=DIR
--lora-merge-cache DIR, ...  refused: model+LoRA references are not read; merge the adapter first
--no-copy-tokenizer, ...     refused where mergelab always does the thing (see above)
===========================  =====================================================================
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# flag -> (dest, takes a value, help). Every flag keeps its mergekit spelling.
ALWAYS = {
    "--lazy-unpickle": "always on: safetensors are memory-mapped and read tensor by tensor "
    "(no pickles are read)",
    "--copy-tokenizer": "always on: the base's tokenizer files are copied to the output",
    "--trust-remote-code": "accepted, changes nothing: mergelab reads config.json and "
    "safetensors only, never a model's code",
    "--clone-tensors": "always on: each output tensor is written from its own buffer",
    "--write-model-card": "always on: README.md records the config and the inputs",
    "--safe-serialization": "always on: the output is safetensors",
    "--async-write": "always on: shards are written by a background thread",
}
# --no-X of the flags above: mergelab cannot leave the thing out.
NEVER_WITHOUT = {
    "--no-lazy-unpickle": "mergelab always reads tensors lazily; drop --no-lazy-unpickle",
    "--no-copy-tokenizer": "mergelab always writes the base's tokenizer with the merge (a "
    "loadable model); delete the tokenizer files afterwards if they are not wanted",
    "--no-trust-remote-code": None,  # accepted: mergelab runs no model code either way
    "--no-clone-tensors": None,  # accepted: nothing to clone or not
    "--no-write-model-card": "mergelab always writes the model card (README.md); delete it "
    "afterwards if it is not wanted",
    "--no-safe-serialization": "mergelab writes safetensors only; convert the output "
    "afterwards if pickles are needed",
    "--no-async-write": None,  # accepted: the order of the writes does not change the output
}
GPU = "mergelab merges on the CPU, streamed tensor by tensor with compiled loops "
GPU += "(docs/merge_performance.md): drop {flag}"
REFUSED_SWITCHES = {
    "--cuda": GPU,
    "--low-cpu-memory": GPU,
    "--read-to-gpu": GPU,
    "--multi-gpu": GPU,
    "--gpu-rich": GPU,
    "--no-cuda": None,
    "--no-low-cpu-memory": None,
    "--no-read-to-gpu": None,
    "--no-multi-gpu": None,
    "--allow-crimes": "mergelab merges models of one architecture only (tensors matched by name "
    "and shape); there is no equivalent of --allow-crimes",
    "--no-allow-crimes": None,
    "--unsafe-truncate-embeddings": "mergelab's equivalent: --vocab-padding truncate (mergelab's "
    "dialect), or tokenizer_source in a mergekit config",
    "--no-unsafe-truncate-embeddings": None,
    "--no-quiet": None,  # accepted: progress is shown unless --quiet / --no-progress
}
REFUSED_VALUES = {
    "--out-shard-size": "mergekit's --out-shard-size counts parameters, mergelab's --shard-size "
    "bytes: for {value} parameters use --shard-size {bf16} (bfloat16/float16) or --shard-size "
    "{fp32} (float32)",
    "--transformers-cache": "set HF_HUB_CACHE={value} instead: mergelab finds hub models in the "
    "Hugging Face cache",
    "--lora-merge-cache": "mergelab does not read mergekit's model+LoRA references: merge the "
    "adapter into its model first (mergelab merge --lora-output full) and name that folder",
    "--lora-merge-dtype": "mergelab does not read mergekit's model+LoRA references: merge the "
    "adapter into its model first (mergelab merge --lora-output full) and name that folder",
    "--write-threads": "mergelab writes with one background thread; drop --write-threads",
}

SWITCH_HELP = {
    "allow-crimes": "one architecture only, tensors matched by name and shape",
    "unsafe-truncate-embeddings": "use --vocab-padding truncate",
}
REFUSED_VALUES_HELP = {
    "--out-shard-size": "counts parameters; mergelab's --shard-size counts bytes",
    "--transformers-cache": "set HF_HUB_CACHE instead",
    "--lora-merge-cache": "model+LoRA references are not read; merge the adapter first",
    "--lora-merge-dtype": "model+LoRA references are not read; merge the adapter first",
    "--write-threads": "mergelab writes with one background thread",
}


def _dest(flag: str) -> str:
    return "mk_" + flag.lstrip("-").replace("-", "_")


def add_mergekit_flags(parser: argparse.ArgumentParser) -> None:
    """mergekit-yaml's flags, in a group of their own in ``--help``."""
    g = parser.add_argument_group(
        "mergekit-yaml's flags (accepted with their meaning, or refused naming mergelab's way)"
    )
    for flag, text in ALWAYS.items():
        g.add_argument(flag, dest=_dest(flag), action="store_true", help=text)
    for flag, text in NEVER_WITHOUT.items():
        g.add_argument(
            flag,
            dest=_dest(flag),
            action="store_true",
            help=argparse.SUPPRESS if text is None else "refused: " + text.split(";")[0],
        )
    for flag, text in REFUSED_SWITCHES.items():
        shown = SWITCH_HELP.get(flag.removeprefix("--"), "merges run on the CPU only")
        g.add_argument(
            flag,
            dest=_dest(flag),
            action="store_true",
            help=argparse.SUPPRESS if text is None else "refused: " + shown,
        )
    g.add_argument(
        "--random-seed", dest="mk_random_seed", type=int, metavar="N", help="as --seed N"
    )
    g.add_argument("--quiet", dest="mk_quiet", action="store_true", help="as --no-progress")
    g.add_argument(
        "-j",
        "--num-threads",
        dest="mk_num_threads",
        type=int,
        metavar="N",
        help="torch threads, which mergelab's merge threads follow",
    )
    g.add_argument(
        "--device",
        dest="mk_device",
        metavar="DEVICE",
        help="cpu only: mergelab merges on the CPU (other devices refused)",
    )
    for flag, text in REFUSED_VALUES_HELP.items():
        g.add_argument(flag, dest=_dest(flag), metavar="VALUE", help="refused: " + text)
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="CONFIG OUT",
        help="mergekit-yaml's order: the config file and the output folder (or OUT alone "
        "after --config)",
    )


def apply_mergekit_flags(args: argparse.Namespace) -> None:
    """Map the mergekit flags that were given onto mergelab's arguments, or refuse them (a
    ``ValueError`` with one line); then read the positional CONFIG / OUT."""
    for flag, text in {**NEVER_WITHOUT, **REFUSED_SWITCHES}.items():
        if getattr(args, _dest(flag), False) and text is not None:
            raise ValueError(f"{flag}: {text.format(flag=flag)}")
    for flag, text in REFUSED_VALUES.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            raise ValueError(f"{flag} {value}: {text.format(**_sizes(value))}")
    device = getattr(args, "mk_device", None)
    if device is not None and device.strip().lower() != "cpu":
        raise ValueError(f"--device {device}: {GPU.format(flag='--device ' + device)}")
    seed = getattr(args, "mk_random_seed", None)
    if seed is not None:
        if args.seed is not None and args.seed != seed:
            raise ValueError(f"--random-seed {seed} and --seed {args.seed} disagree; give one")
        args.seed = seed
    if getattr(args, "mk_quiet", False):
        args.no_progress = True
    threads = getattr(args, "mk_num_threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    _positional(args)


def _sizes(value: str) -> dict[str, str]:
    """mergekit's parameter count (``5B``, ``500M``, ``1000``) as byte sizes for --shard-size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s*", str(value))
    if not match:
        return {"value": value, "bf16": "2GB", "fp32": "4GB"}
    n = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[match.group(2).lower()]
    return {"value": value, "bf16": _bytes(2 * n), "fp32": _bytes(4 * n)}


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}B"


def _positional(args: argparse.Namespace) -> None:
    """``CONFIG OUT`` (mergekit-yaml's order), ``OUT`` after ``--config`` or after a merge given
    by flags (``--method``), or ``CONFIG`` alone when it is a .yml/.yaml/.toml file; anything
    else is refused naming the forms that are read."""
    paths = list(getattr(args, "paths", None) or [])
    if not paths:
        return
    if args.config is None and Path(paths[0]).suffix.lower() in (".yml", ".yaml", ".toml"):
        args.config = paths.pop(0)
    if args.config is None and not args.method and len(paths) == 2:
        raise ValueError(
            f"{paths[0]} is not a .yml, .yaml or .toml merge config: give the config first "
            "(mergelab merge config.yml OUT)"
        )
    if len(paths) > 1 or (paths and args.config is None and not args.method):
        raise ValueError(
            f"unexpected {' '.join(paths)}: mergelab merge takes CONFIG OUT, --config CONFIG "
            "OUT, or --method ... OUT (models go after --model or --models)"
        )
    if paths:
        if args.output is not None and args.output != paths[0]:
            raise ValueError(f"two outputs: --out {args.output} and {paths[0]}; give one")
        args.output = paths[0]
