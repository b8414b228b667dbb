"""Building the candidate of a grid point: load models (with accelerate's ``device_map`` /
``max_memory`` / ``offload_folder`` when the spec asks), merge, compose.

A merge whose inputs are all checkpoint folders is streamed to disk once by
:func:`mergelab.merge.checkpoint.merge_checkpoints` (LoRA merges by
:func:`mergelab.merge.lora.merge_lora_adapters`) into ``<cache>/merges/<method>-<key>``, the key
hashing the method, parameters, weights, inputs and seed; a rerun finds it there. In-memory
models are merged in memory with :func:`mergelab.merge.merge_models`. A LoRA merge writes a full
model from the base's folder; an in-memory base is saved once to ``<cache>/base-<checksum>`` for
it. The last merged model is kept, so the jobs of one grid point (one per benchmark, run one
after the other) build it once.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from mergelab.compare.plan import Point, fingerprint
from mergelab.compare.spec import CompareSpec

MERGE_RECORD = "mergelab_merge.json"  # written last by both merge engines


def _stat(path: str) -> list[Any]:
    """What identifies a folder's content cheaply: name, size and mtime of each file."""
    out = []
    for root, _, files in os.walk(path):
        for f in sorted(files):
            st = os.stat(os.path.join(root, f))
            out.append([os.path.relpath(os.path.join(root, f), path), st.st_size, st.st_mtime_ns])
    return sorted(out)


class ModelStore:
    """Loads each model of a spec once per process (the base, experts, the tokenizer)."""

    def __init__(self, spec: CompareSpec, cache_dir: Path):
        self.spec, self.cache_dir = spec, Path(cache_dir)
        self._models: dict[str, torch.nn.Module] = {}
        self._tokenizer = None
        self._identity: dict[str, Any] | None = None
        self._last_merge: tuple[str, torch.nn.Module] | None = None  # (key, merged model)
        self._saved: dict[str, Any] = {}  # saved compositions' decoders, by folder

    def __getstate__(self) -> dict[str, Any]:  # shipped to Ray workers without loaded models
        return {
            **self.__dict__,
            "_models": {},
            "_tokenizer": None,
            "_last_merge": None,
            "_saved": {},
        }

    # -- identities (cache keys) ---------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """Every input model and the tokenizer, by path+file stats or parameter checksum."""
        if self._identity is None:
            from mergelab.compose.vocab import tokenizer_fingerprint

            models = {}
            for name, src in self.spec.models.items():
                d = src.describe()
                if src.kind != "memory":
                    d["files"] = fingerprint(_stat(src.path))
                models[name] = d
            tok = self.spec.tokenizer
            tok_id = tok if isinstance(tok, str) else tokenizer_fingerprint(tok)
            self._identity = {"models": models, "tokenizer": tok_id, "loading": self.spec.loading}
            saved = {f.path: _saved_identity(f.path) for f in self.spec.families if f.path}
            if saved:  # absent otherwise, so earlier runs' job keys stay valid
                self._identity["saved_compositions"] = saved
        return self._identity

    # -- loading -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        dev = self.spec.loading.get("device", "cpu")
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(dev)

    def tokenizer(self):
        if self._tokenizer is None:
            tok = self.spec.tokenizer
            if isinstance(tok, str):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tok)
            self._tokenizer = tok
        return self._tokenizer

    def load_folder(self, path: str | Path) -> torch.nn.Module:
        """``AutoModelForCausalLM`` with the spec's dtype, and device_map / max_memory /
        offload_folder passed to accelerate when given (then the model is not moved)."""
        from transformers import AutoModelForCausalLM

        lo = self.spec.loading
        kwargs: dict[str, Any] = {"dtype": getattr(torch, lo.get("dtype", "float32"))}
        if lo.get("device_map") is not None:
            # copies: transformers rewrites max_memory in place, and the spec keys the caches
            dm = lo["device_map"]
            kwargs["device_map"] = dict(dm) if isinstance(dm, dict) else dm
            if lo.get("max_memory"):
                kwargs["max_memory"] = dict(lo["max_memory"])
            if lo.get("offload_folder"):
                kwargs["offload_folder"] = lo["offload_folder"]
            return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(self.device).eval()

    def model(self, name: str) -> torch.nn.Module:
        """The base or a full expert (an adapter expert: PEFT's merge into a copy of the base)."""
        if name not in self._models:
            src = self.spec.models[name]
            if src.kind == "memory":
                model = src.obj
            elif src.kind == "folder":
                model = self.load_folder(src.path)
            else:
                from peft import PeftModel

                model = PeftModel.from_pretrained(copy.deepcopy(self.model("base")), src.path)
                model = model.merge_and_unload().eval()
            self._models[name] = model
        return self._models[name]

    # -- merges --------------------------------------------------------------------------------

    def streams_merge(self, point: Point) -> bool:
        """Whether this merge is computed from folders on disk (else in memory)."""
        fam = point.family
        if fam.family == "lora_merge":
            return True
        if fam.family != "merge":
            return False
        return all(self.spec.models[n].kind == "folder" for n in merge_inputs(fam))

    def merge_folder(self, point: Point, seed: int) -> Path:
        fam = point.family
        key = fingerprint(
            {
                "family": fam.family,
                "method": fam.method,
                "params": {**fam.params, **point.params},
                "weights": fam.weights,
                "experts": fam.experts,
                "seed": seed,
                "inputs": {n: self.identity()["models"][n] for n in merge_inputs(fam)},
                **({} if fam.use_base else {"use_base": False}),
            }
        )
        return self.cache_dir / "merges" / f"{fam.name}-{key[:16]}"

    def ensure_merge(self, point: Point, seed: int, progress: bool = False) -> Path:
        """Stream the merge to its cache folder unless it is there already."""
        folder = self.merge_folder(point, seed)
        if (folder / MERGE_RECORD).is_file():
            return folder
        fam = point.family
        params = {**fam.params, **point.params}
        weights = list(fam.weights) if fam.weights is not None else None
        if fam.family == "merge":
            from mergelab.merge.checkpoint import merge_checkpoints

            merge_checkpoints(
                fam.method,
                self.spec.models["base"].path if fam.use_base else None,
                [self.spec.models[n].path for n in fam.experts],
                output=folder,
                params=params,
                weights=weights,
                seed=seed,
                force=True,
                progress=progress,
            )
        else:
            from mergelab.merge.lora import merge_lora_adapters

            merge_lora_adapters(
                fam.method,
                [self.spec.models[n].path for n in fam.experts],
                output=folder,
                base=self.base_folder(),
                output_kind="full",
                params=params,
                weights=weights,
                seed=seed,
                force=True,
                progress=progress,
            )
        return folder

    def base_folder(self) -> Path:
        """The base as a model folder: its own, or (an in-memory base) a copy saved once with
        ``save_pretrained`` to ``<cache>/base-<parameter checksum>``."""
        base = self.spec.models["base"]
        if base.kind == "folder":
            return Path(base.path)
        from mergelab.outputs import atomic_output_dir

        folder = self.cache_dir / f"base-{fingerprint(self.identity()['models']['base'])[:16]}"
        if not (folder / "config.json").is_file():
            with atomic_output_dir(folder, force=True) as tmp:
                self.model("base").save_pretrained(tmp)
        return folder

    def merged_model(self, point: Point, seed: int) -> torch.nn.Module:
        """The merged model of ``point``: streamed from its folder or merged in memory; the last
        one is kept, so consecutive jobs of one grid point build it once."""
        fam = point.family
        key = fingerprint({"family": fam.to_dict(), "point": point.to_dict(), "seed": seed})
        if self._last_merge is not None and self._last_merge[0] == key:
            return self._last_merge[1]
        self._last_merge = None  # free the previous merge before building the next
        if self.streams_merge(point):
            model = self.load_folder(self.ensure_merge(point, seed))
        else:
            from mergelab.merge import merge_models

            model = merge_models(
                fam.method,
                self.model("base") if fam.use_base else None,
                [self.model(e) for e in fam.experts],
                params={**fam.params, **point.params},
                weights=list(fam.weights) if fam.weights is not None else None,
                seed=seed,
            )
        self._last_merge = (key, model)
        return model

    # -- candidates ----------------------------------------------------------------------------

    def candidate(self, point: Point, seed: int):
        """The :class:`~mergelab.candidate.Candidate` of ``point`` (merges must be prepared)."""
        from mergelab import ModelCandidate
        from mergelab.compose import ComposedDecoder
        from mergelab.compose.formula import Composition

        fam, name = point.family, point.candidate_name
        if fam.path is not None:  # a composition saved by `mergelab compose --save`
            from mergelab.compose import ComposedDecoder

            if fam.path not in self._saved:
                lo = self.spec.loading
                self._saved[fam.path] = ComposedDecoder.from_pretrained(
                    fam.path, dtype=lo.get("dtype", "float32"), device=self.device, name=name
                )
            return self._saved[fam.path]
        tok = self.tokenizer()
        if fam.family == "base":
            return ModelCandidate(self.model("base"), tok, name=name)
        if fam.family == "expert":
            return ModelCandidate(self.model(point.expert), tok, name=name)
        if fam.family in ("merge", "lora_merge"):
            return ModelCandidate(self.merged_model(point, seed), tok, name=name)
        p = point.params
        eos = p.get("eos_policy", fam.eos_policy)
        weights: list[float] | None = list(fam.weights) if fam.weights is not None else None
        if "weight" in p:
            weights = [float(p["weight"])] * len(fam.experts)
        if "weights" in p:
            weights = [float(w) for w in p["weights"]]
        if fam.family == "lora_composition":
            adapters = [self.spec.models[e].path for e in fam.experts]
            return ComposedDecoder.from_lora(
                self.model("base"),
                adapters,
                tok,
                weights,
                expert_names=list(fam.experts),
                eos_policy=eos,
                name=name,
            )
        experts = [self.model(e) for e in fam.experts]
        if fam.composition is not None:
            comp = Composition.from_dict(fam.composition)
            models = {"base": self.model("base"), **dict(zip(fam.experts, experts))}
            models = {n: m for n, m in models.items() if n in comp.components}
            return ComposedDecoder.from_models(models, comp, tok, eos_policy=eos, name=name)
        return ComposedDecoder(
            self.model("base"),
            experts,
            tok,
            weights,
            expert_names=list(fam.experts),
            eos_policy=eos,
            name=name,
        )

    def release(self) -> None:
        """Drop the kept merged model (the base and experts stay loaded)."""
        self._last_merge = None


def _saved_identity(path: str) -> dict[str, Any]:
    """A saved composition by its file and every component folder's file stats."""
    from mergelab.compose.composed import COMPOSITION_FILE, CompositionConfig

    saved = CompositionConfig.from_file(path)
    folders = {**saved.models, **saved.adapters}
    return {
        "file": fingerprint(Path(path, COMPOSITION_FILE).read_text(encoding="utf-8")),
        "models": {n: fingerprint(_stat(p)) for n, p in folders.items() if p is not None},
    }


def merge_inputs(family) -> tuple[str, ...]:
    """The models a merge family reads: the base (unless ``use_base`` is false) and its experts."""
    return ("base", *family.experts) if family.use_base else tuple(family.experts)
