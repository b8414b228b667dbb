"""A candidate from a small spec file: one model, a composition, or a merge made in memory.

The same file drives ``mergelab eval run --spec`` and the lm-evaluation-harness bridge
(``lm_eval --model mergelab --model_args spec=compose.yaml``). Exactly one of ``model``,
``base`` or ``merge`` says what the candidate is::

    # one model folder (a saved merge is one too), or a composition saved by
    # `mergelab compose --save` / ComposedDecoder.save_pretrained
    model: models/merged

    # a logit composition: base + Σ w_i·(expert_i − base)
    base: models/base
    experts: [models/math, models/code]   # model folders; PEFT adapter folders with lora: true
    expert_names: [math, code]            # optional, default expert1..k
    weights: [1.0, 0.5]                   # optional, default 1 each (the paper's rule)
    eos_policy: base                      # optional, one of mergelab.compose.EOS_POLICIES
    lora: false                           # optional: experts are LoRA adapters of the base

    # a weight merge computed in memory: a `mergelab merge` config (mergelab's dialect)
    merge:
      method: ties
      base: models/base
      models: [models/math, models/code]
      parameters: {density: 0.2}

Any of them may add ``name`` (the row label), ``tokenizer`` (a folder; default: the model's,
the base's, or for a merge its base's or first model's folder), ``dtype`` (float32, bfloat16,
float16; default: as transformers loads the checkpoint) and ``device`` (cpu, cuda, cuda:1, ...). Relative paths are resolved against the
folder holding the spec file. Instead of a file, a model folder may be given where a spec is
expected: it means ``model: <folder>``. Everything is loaded offline (``local_files_only``).

:func:`parse_candidate_spec` is the one parser (file, folder or mapping → :class:`CandidateSpec`);
:func:`build_candidate` loads the models.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_KEYS = {
    "model",
    "base",
    "experts",
    "expert_names",
    "weights",
    "eos_policy",
    "lora",
    "merge",
    "tokenizer",
    "name",
    "dtype",
    "device",
}
COMPOSITION_KEYS = {"experts", "expert_names", "weights", "eos_policy", "lora"}


@dataclass(frozen=True)
class CandidateSpec:
    """A parsed spec: ``kind`` is ``"model"``, ``"composition"`` or ``"merge"``; paths absolute.

    ``merge`` holds the parsed :class:`mergelab.merge.config.MergeConfig` for a merge.
    """

    kind: str
    model: str | None = None
    base: str | None = None
    experts: tuple[str, ...] = ()
    expert_names: tuple[str, ...] | None = None
    weights: tuple[float, ...] | None = None
    eos_policy: str = "plain"
    lora: bool = False
    merge: Any = None
    tokenizer: str | None = None
    name: str | None = None
    dtype: str | None = None  # None: as transformers loads the checkpoint
    device: str = "cpu"
    source: str | None = field(default=None, compare=False)  # the file it was read from

    def inputs(self) -> list[str]:
        """Every folder the candidate is read from (for output-overlap checks)."""
        paths = [self.model, self.base, *self.experts, self.tokenizer, self.source]
        if self.merge is not None:
            paths += [self.merge.base, *(m.path for m in self.merge.models)]
        return [p for p in paths if p is not None]

    def tokenizer_folder(self) -> str:
        if self.tokenizer is not None:
            return self.tokenizer
        if self.kind == "merge":
            return self.merge.base or self.merge.models[0].path
        return self.model if self.kind == "model" else self.base  # type: ignore[return-value]

    def default_name(self) -> str:
        if self.name:
            return self.name
        if self.kind == "model":
            return Path(self.model).name  # type: ignore[arg-type]
        if self.kind == "merge":
            return f"{self.merge.method}({', '.join(Path(m.path).name for m in self.merge.models)})"
        return ""  # a composition names itself by its formula


def parse_candidate_spec(
    spec: str | os.PathLike | Mapping[str, Any], root: str | os.PathLike | None = None
) -> CandidateSpec:
    """A :class:`CandidateSpec` from a spec file (YAML), a model folder, or a parsed mapping.

    Errors name the key. ``root`` resolves relative paths of a mapping (default: the current
    folder; for a file, the file's folder).
    """
    from mergelab.compose.eos import EOS_POLICIES
    from mergelab.inputs import read_config_bytes
    from mergelab.merge.config import load_yaml, merge_config_from_dict, parse_dtype

    source = None
    if not isinstance(spec, Mapping):
        path = Path(os.path.expanduser(str(spec)))
        if path.is_dir():
            return CandidateSpec(kind="model", model=str(path.resolve()), source=None)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"candidate spec {path} not found (a spec file or model folder)"
            )
        data = read_config_bytes(path, "candidate spec")  # a FIFO or /dev/zero: refused unread
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"candidate spec {path}: not UTF-8 (byte offset {exc.start})"
            ) from None
        raw = load_yaml(text, path)
        if not isinstance(raw, Mapping):
            raise ValueError(f"candidate spec {path}: expected a mapping of keys to values")
        source, root = str(path.resolve()), path.resolve().parent
        where = f"candidate spec {path}"
    else:
        raw, where = spec, "candidate spec"
    root = Path(root if root is not None else ".")

    unknown = sorted(str(k) for k in set(raw) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(SPEC_KEYS)}")
    given = [k for k in ("model", "base", "merge") if raw.get(k) is not None]
    if len(given) != 1:
        raise ValueError(
            f"{where}: give exactly one of 'model' (a folder), 'base' (+ 'experts': a "
            f"composition) or 'merge' (a merge config); got {given or 'none'}"
        )
    kind = {"model": "model", "base": "composition", "merge": "merge"}[given[0]]
    if kind != "composition":
        extra = sorted(k for k in COMPOSITION_KEYS if k in raw)
        if extra:
            raise ValueError(f"{where}: {extra} only apply to a composition (with 'base')")

    def folder(key: str, value: Any) -> str:
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"{where}: {key!r} must be a folder path, got {value!r}")
        p = Path(os.path.expanduser(str(value)))
        return str(p if p.is_absolute() else (root / p).resolve())

    def strings(key: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{where}: {key!r} must be a non-empty list, got {value!r}")
        return tuple(value)

    options: dict[str, Any] = {}
    if raw.get("name") is not None:
        options["name"] = str(raw["name"])
    if raw.get("tokenizer") is not None:
        options["tokenizer"] = folder("tokenizer", raw["tokenizer"])
    if raw.get("dtype") is not None:
        parse_dtype(raw["dtype"])  # refuses an unknown dtype, naming it
        options["dtype"] = str(raw["dtype"])
    if raw.get("device") is not None:
        options["device"] = str(raw["device"])

    if kind == "model":
        return CandidateSpec(kind, model=folder("model", raw["model"]), source=source, **options)
    if kind == "merge":
        merge_raw = raw["merge"]
        if not isinstance(merge_raw, Mapping):
            raise ValueError(f"{where}: 'merge' must be a merge config mapping (method, models…)")
        if "merge_method" in merge_raw:
            raise ValueError(
                f"{where}: 'merge' is in mergekit's dialect; write it with mergelab's keys "
                "(method, base, models, parameters) or run `mergelab merge` and give the output "
                "folder as 'model'"
            )
        if merge_raw.get("output", merge_raw.get("out")) is not None:
            raise ValueError(f"{where}: a spec merges in memory; drop merge.output")
        config = merge_config_from_dict(dict(merge_raw), root=root)
        return CandidateSpec(kind, merge=config, source=source, **options)

    experts = tuple(folder("experts", e) for e in strings("experts", raw.get("experts")))
    names = raw.get("expert_names")
    if names is not None:
        names = tuple(str(n) for n in strings("expert_names", names))
        if len(names) != len(experts):
            raise ValueError(f"{where}: {len(names)} expert_names for {len(experts)} experts")
    weights = raw.get("weights")
    if weights is not None:
        weights = strings("weights", weights)
        if len(weights) != len(experts):
            raise ValueError(f"{where}: {len(weights)} weights for {len(experts)} experts")
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
            raise ValueError(f"{where}: 'weights' must be numbers, got {list(weights)}")
        weights = tuple(float(w) for w in weights)
    policy = str(raw.get("eos_policy", "plain"))
    if policy not in EOS_POLICIES:
        raise ValueError(f"{where}: eos_policy {policy!r} is not one of {EOS_POLICIES}")
    lora = raw.get("lora", False)
    if not isinstance(lora, bool):
        raise ValueError(f"{where}: 'lora' must be true or false, got {lora!r}")
    return CandidateSpec(
        kind,
        base=folder("base", raw["base"]),
        experts=experts,
        expert_names=names,
        weights=weights,
        eos_policy=policy,
        lora=lora,
        source=source,
        **options,
    )


def build_candidate(
    spec: CandidateSpec | str | os.PathLike | Mapping[str, Any],
    *,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
):
    """Load the models of ``spec`` and return the candidate (a ``ModelCandidate`` or a
    ``ComposedDecoder``). ``device`` / ``dtype`` override the spec's; ``trust_remote_code`` is
    passed to transformers (a checkpoint's own modelling code runs only when it is true)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergelab.compose import ComposedDecoder
    from mergelab.compose.vocab import check_shipped_tokenizers
    from mergelab.inputs import check_model_folder
    from mergelab.merge.config import parse_dtype
    from mergelab.model_candidate import ModelCandidate

    if not isinstance(spec, CandidateSpec):
        spec = parse_candidate_spec(spec)
    device = device or spec.device
    torch_dtype = parse_dtype(dtype or spec.dtype)
    for path in spec.inputs():
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} (named in the candidate spec) not found")
        check_model_folder(path)

    def load(path: str):
        kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code, **kwargs
        )
        return model.to(device).eval()

    from mergelab.compose.composed import is_composition_folder

    if spec.kind == "model" and is_composition_folder(spec.model):  # compose --save wrote it
        if spec.tokenizer is not None:
            raise ValueError(f"{spec.model} is a saved composition: it names its own tokenizer")
        named = {"name": spec.name} if spec.name else {}
        return ComposedDecoder.from_pretrained(
            spec.model, dtype=torch_dtype, device=device, **named
        )
    tokenizer = AutoTokenizer.from_pretrained(
        spec.tokenizer_folder(), local_files_only=True, trust_remote_code=trust_remote_code
    )
    if spec.kind == "model":
        return ModelCandidate(load(spec.model), tokenizer, name=spec.default_name())
    if spec.kind == "merge":
        from mergelab.lora import is_lora_adapter
        from mergelab.merge import merge_models
        from mergelab.vocabulary import check_merge_tokenizers

        config = spec.merge
        adapters = [m.path for m in config.models if is_lora_adapter(m.path)]
        if adapters:
            raise ValueError(
                f"merging LoRA adapters in memory is not supported ({adapters}); run "
                "`mergelab merge` and give the output folder as 'model'"
            )
        inputs = [p for p in [config.base, *(m.path for m in config.models)] if p is not None]
        check_merge_tokenizers(inputs, inputs)  # rows are merged by id
        base = load(config.base) if config.base else None
        experts = [load(m.path) for m in config.models]
        params, per_model = config.split_params()
        merged = merge_models(
            config.method,
            base,
            experts,
            params=params,
            per_model_params=per_model,
            dtype=parse_dtype(config.dtype),
            seed=config.seed,
            vocab_padding=config.vocab_padding,
        )
        return ModelCandidate(merged, tokenizer, name=spec.default_name())

    # A composition: experts that ship a tokenizer must ship the base's.
    check_shipped_tokenizers(tokenizer, spec.tokenizer_folder(), spec.experts)
    common = dict(
        expert_names=list(spec.expert_names) if spec.expert_names else None,
        eos_policy=spec.eos_policy,
        name=spec.name,
    )
    weights = list(spec.weights) if spec.weights is not None else None
    if spec.lora:
        from mergelab.compose.lora import check_adapters_fit

        check_adapters_fit(spec.base, spec.experts)  # before the base is loaded
        return ComposedDecoder.from_lora(
            load(spec.base), list(spec.experts), tokenizer, weights, **common
        )
    return ComposedDecoder(
        load(spec.base), [load(p) for p in spec.experts], tokenizer, weights, **common
    )
