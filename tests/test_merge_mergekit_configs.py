"""mergekit's own example configs, run by mergekit 0.1.5 and by ``mergelab merge --config``, give
the same model, tensor by tensor.

The configs are mergekit's ``examples/*.yml`` (tests/fixtures/mergekit_examples, hub names kept:
a tiny Llama is written at each of those relative paths, and a local folder wins over a hub
name), plus one config per method mergelab added from mergekit. mergekit runs in this process
through its Python API (``run_merge``) from the folder holding the config and the models, as
``mergekit-yaml`` would; mergelab runs through its command line entry point.

Tolerances:

* float32: rtol = atol = 1e-6 (the same terms, summed in possibly another order).
* float16/bfloat16 for linear, slerp and passthrough: equal, bit for bit (both compute in float32
  from inputs rounded to the dtype, or only copy).
* float16/bfloat16 for mergekit's task-arithmetic family (ties here): both compute in the half
  dtype in mergekit's order (each w_i·τ_i rounded with w_i in the dtype, the terms summed in
  float32 and rounded once, docs/mergekit.md § Precision). Entries may differ only where the
  two tools make a discrete choice differently: a magnitude tied with the trim threshold
  (mergekit's sort keeps exactly k entries, mergelab every entry tied with the k-th), or a sign
  vote Σ w_i τ_i within rounding of zero. The test checks that every differing entry is at such
  a tie, and that the same config in float32 agrees to 1e-6.

Random methods: mergelab draws from generators seeded by (seed, tensor name); mergekit from
torch's global generator. mergekit's task-arithmetic kernel is wrapped so that it draws what
mergelab draws for the same tensor: for DELLA torch's global generator is seeded like mergelab's
torch generator, for DARE (whose masks mergelab draws with a faster generator of its own)
mergekit's ``torch.bernoulli`` returns mergelab's masks. The results are then compared like the
deterministic ones.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from _reference import require
from safetensors.torch import load_file
from test_merge_config_dialects import WORDS, tiny_tokenizer, write_model  # tiny checkpoints

from mergelab.cli import main
from mergelab.merge import TensorContext, list_merge_methods
from mergelab.merge.methods import steps

require("mergekit")
from mergekit.config import MergeConfiguration  # noqa: E402
from mergekit.io.tasks import LoaderCache  # noqa: E402
from mergekit.merge import MergeOptions, run_merge  # noqa: E402
from mergekit.merge_methods.generalized_task_arithmetic import (  # noqa: E402
    GeneralizedTaskArithmeticMerge,
)
from mergekit.sparsify import SparsificationMethod  # noqa: E402

EXAMPLES = Path(__file__).parent / "fixtures" / "mergekit_examples"
TOL = {"rtol": 1e-6, "atol": 1e-6}
SEED = 7

# Local stand-ins for the hub models the examples name: (family, size of the fine-tuning noise).
MODELS = {
    "TheBloke/Llama-2-13B-fp16": ("llama", 0.0),
    "psmathur/orca_mini_v3_13b": ("llama", 0.02),
    "garage-bAInd/Platypus2-13B": ("llama", 0.015),
    "WizardLM/WizardLM-13B-V1.2": ("llama", 0.01),
    "WizardLM/WizardMath-13B-V1.0": ("llama", 0.025),
    "mistralai/Mistral-7B-v0.1": ("mistral", 0.0),
    "mistralai/Mistral-7B-Instruct-v0.2": ("mistral", 0.02),
    "BioMistral/BioMistral-7B": ("mistral", 0.01),
    "model_a": ("fusion", 0.0),
    "model_b": ("fusion", 0.03),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A folder holding a tiny checkpoint at every model name the example configs use."""
    root = tmp_path_factory.mktemp("zoo")
    for name, (family, noise) in MODELS.items():
        write_model(root / name, family, noise)
    return root


def read(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@contextlib.contextmanager
def mergekit_draws_like_mergelab(seed: int):
    """mergekit's task-arithmetic merges draw what mergelab draws for the same tensor: DELLA's
    masks by seeding torch's global generator as mergelab's per-tensor torch generator (both call
    ``torch.bernoulli`` on the same probabilities), DARE's by handing mergekit's
    ``torch.bernoulli`` mergelab's masks (``steps.dare_keep_mask``, its own faster generator), one
    per model with density < 1, in order."""
    original = GeneralizedTaskArithmeticMerge.merge_group

    def seeded(self, group, /, **parameters):
        ctx = TensorContext(name=group.metadata.name, seed=seed)
        with torch.random.fork_rng(), contextlib.ExitStack() as stack:
            torch.manual_seed(ctx.generator().initial_seed())
            if self.sparsification_method == SparsificationMethod.random:
                shape = group.base.tensor.shape
                densities = [parameters["density"][e.id] for e in group.non_base]
                masks = iter(
                    [
                        steps.dare_keep_mask(shape, d, ctx.tensor_seed, i)
                        for i, d in enumerate(densities)
                        if d < 1
                    ]
                )
                stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                    torch, "bernoulli", lambda p, *a, **k: next(masks).to(p.dtype)
                )
            return original(self, group, **parameters)

    GeneralizedTaskArithmeticMerge.merge_group = seeded
    try:
        yield
    finally:
        GeneralizedTaskArithmeticMerge.merge_group = original


def run_mergekit(config: Path, out: Path, monkeypatch, *, seed: int = SEED) -> Path:
    """``mergekit-yaml config out`` in-process, from the config's folder (mergekit resolves
    relative model paths against the working folder)."""
    monkeypatch.chdir(config.parent)
    LoaderCache().loaders.clear()  # its loaders are keyed by the path as written
    raw = yaml.safe_load(config.read_text())
    options = MergeOptions(quiet=True, random_seed=seed, write_model_card=False)
    with mergekit_draws_like_mergelab(seed):
        run_merge(MergeConfiguration.model_validate(raw), str(out), options)
    return out


def run_mergelab(config: Path, out: Path, *extra: str) -> Path:
    code = main(["merge", "--config", str(config), "--out", str(out), "--no-progress", *extra])
    assert code == 0
    return out


def place(zoo: Path, text: str, name: str = "merge.yml") -> Path:
    """The config written into the zoo folder, where its relative model paths resolve."""
    path = zoo / name
    path.write_text(text)
    return path


def assert_same_model(ours: Path, theirs: Path, *, explained=None) -> None:
    """Every tensor of mergekit's output equal to ours (float32: to 1e-6; half dtypes: bit for
    bit, or where ``explained(name, ours, theirs)`` says the entries may differ)."""
    a, b = read(ours), read(theirs)
    assert sorted(a) == sorted(b)
    for name in b:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if y.dtype == torch.float32 or not y.is_floating_point():
            torch.testing.assert_close(x, y, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            continue
        differ = x != y
        if explained is not None:
            differ &= ~explained(name, x, y)
        assert not differ.any(), f"{name}: {int(differ.sum())} of {differ.numel()} entries differ"


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@contextlib.contextmanager
def half_precision_gta(config: Path):
    """For a half-precision task-arithmetic config (module docstring): a function
    ``(name, ours, theirs) -> mask`` of the entries allowed to differ: a tie (a magnitude equal
    to an expert's trim threshold; a sign vote Σ w_i τ_i within rounding of zero), and the
    counts (``stats``: differing entries within one rounding step, at a tie, off any tie).
    Inputs and parameters per tensor are those mergelab's plan resolved."""
    from mergelab.merge.config import load_merge_config, locate_model
    from mergelab.merge.mergekit_dialect import plan_mergekit_merge

    loaded = load_merge_config(config)
    planned = plan_mergekit_merge(loaded, lambda ref: locate_model(ref, [config.parent])[0])
    stats = {"rounding": 0, "ties": 0, "off_ties": 0, "entries": 0}

    def explained(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        recipe, dtype = planned.plan.recipes[name], planned.plan.input_dtype
        eps = torch.finfo(dtype).eps
        base = recipe.base.folder.read(recipe.base.name).to(dtype)
        experts = [s.folder.read(s.name).to(dtype) for s in recipe.experts]
        scale = torch.stack([base, *experts, theirs]).double().abs().amax(0)
        rounding = (ours.double() - theirs.double()).abs() <= 2 * eps * scale
        density = recipe.per_model.get("density", [1.0] * len(experts))
        tie = torch.zeros(base.shape, dtype=torch.bool)
        votes = []
        for expert, d, w in zip(experts, density, recipe.per_model["weight"]):
            tau = expert - base
            size = tau.abs().float()
            if d < 1:
                k = max(1, int(d * tau.numel()))
                threshold = size.flatten().sort(descending=True).values[k - 1]
                tie |= size == threshold
                tau = tau * (size >= threshold)
            votes.append(w * tau.double())
        total, spread = sum(votes), sum(v.abs() for v in votes)
        tie |= total.abs() <= 8 * eps * spread
        differ = ours != theirs
        stats["rounding"] += int((differ & rounding).sum())
        stats["ties"] += int((differ & ~rounding & tie).sum())
        stats["off_ties"] += int((differ & ~tie).sum())
        stats["entries"] += ours.numel()
        return tie

    try:
        yield explained, stats
    finally:
        planned.close()


# --- mergekit's examples ------------------------------------------------------------------

EXACT_EXAMPLES = ["linear", "gradient-slerp", "orcamini-platy-44layer"]
HALF_GTA_EXAMPLES = ["ties", "bio-merge"]


def one_rounding_step(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Entries at most one unit in the last place of the half dtype apart."""
    eps = torch.finfo(theirs.dtype).eps
    return (ours.double() - theirs.double()).abs() <= eps * theirs.double().abs()


@pytest.mark.parametrize("example", EXACT_EXAMPLES)
def test_examples_equal_mergekit_in_float16(zoo, tmp_path, monkeypatch, example):
    """linear and passthrough: bit for bit. slerp: both compute in float32 and round to
    float16, but the angle's float32 round-off differs, so a float16 rounding may flip (1 ulp)."""
    config = place(zoo, (EXAMPLES / f"{example}.yml").read_text())
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    assert_same_model(ours, theirs, explained=one_rounding_step if "slerp" in example else None)
    assert config_of(ours)["dtype"] == "float16"
    assert config_of(ours)["num_hidden_layers"] == config_of(theirs)["num_hidden_layers"]


@pytest.mark.parametrize("example", HALF_GTA_EXAMPLES)
def test_half_precision_ties_examples_differ_only_by_rounding_and_ties(
    zoo, tmp_path, monkeypatch, example
):
    config = place(zoo, (EXAMPLES / f"{example}.yml").read_text())
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    with half_precision_gta(config) as (explained, stats):
        assert_same_model(ours, theirs, explained=explained)
    # every differing entry is at a tie (before mergekit's order of operations, 290 of the
    # 41,248 entries of the ties example differed off any tie), and ties are rare
    assert stats["off_ties"] == 0 and stats["ties"] < 1e-3 * stats["entries"]


@pytest.mark.parametrize("example", EXACT_EXAMPLES + HALF_GTA_EXAMPLES + ["arcee_fusion"])
def test_examples_in_float32_equal_mergekit(zoo, tmp_path, monkeypatch, example):
    text = (EXAMPLES / f"{example}.yml").read_text()
    text = text.replace("dtype: float16", "dtype: float32").replace(
        "dtype: bfloat16", "dtype: float32"
    )
    config = place(zoo, text)
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    assert_same_model(ours, theirs)


def test_passthrough_stacks_and_renumbers_layers(zoo, tmp_path, monkeypatch):
    """orcamini-platy-44layer style: layers 0-2 of one model, then layers 1-3 of the other,
    renumbered 0-5; config.json says 6 layers; embeddings from the first, head from the last."""
    config = place(zoo, (EXAMPLES / "orcamini-platy-44layer.yml").read_text())
    ours = read(run_mergelab(config, tmp_path / "mergelab"))
    orca, platypus = (read(zoo / m) for m in MODELS if "orca" in m or "Platypus" in m)
    assert config_of(tmp_path / "mergelab")["num_hidden_layers"] == 6
    half = torch.float16
    for out, (src, layer) in enumerate(
        [(orca, 0), (orca, 1), (orca, 2)] + [(platypus, 1), (platypus, 2), (platypus, 3)]
    ):
        name = f"model.layers.{out}.self_attn.q_proj.weight"
        assert torch.equal(
            ours[name], src[f"model.layers.{layer}.self_attn.q_proj.weight"].to(half)
        )
    assert torch.equal(ours["model.embed_tokens.weight"], orca["model.embed_tokens.weight"].half())
    assert torch.equal(ours["lm_head.weight"], platypus["lm_head.weight"].half())


ADDED_METHODS = [
    "della",
    "della_linear",
    "sce",
    "nuslerp",
    "karcher",
    "multislerp",
    "nearswap",
    "arcee_fusion",
]


@pytest.mark.parametrize("method", ADDED_METHODS)
def test_each_added_method_equals_mergekit(zoo, tmp_path, monkeypatch, method):
    """One config per method mergelab took from mergekit, with gradients and filters where the
    method has parameters to vary; della's draws are seeded alike (module docstring)."""
    assert method in list_merge_methods()
    config = place(zoo, (EXAMPLES / "methods" / f"{method}.yml").read_text())
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab", "--seed", str(SEED))
    assert_same_model(ours, theirs)


def test_arcee_fusion_example_in_bfloat16(zoo, tmp_path, monkeypatch):
    """mergekit's arcee_fusion multiplies by a float32 mask, so with ``dtype: bfloat16`` it
    stores float32 tensors (its config.json still says bfloat16). mergelab stores the dtype the
    config asks for: mergekit's values rounded to bfloat16, bit for bit."""
    config = place(zoo, (EXAMPLES / "arcee_fusion.yml").read_text())
    theirs = read(run_mergekit(config, tmp_path / "mergekit", monkeypatch))
    ours = read(run_mergelab(config, tmp_path / "mergelab"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert tensor.dtype == torch.float32 and ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], tensor.bfloat16()), name
    assert config_of(tmp_path / "mergelab")["dtype"] == "bfloat16"


# --- tokenizers ----------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def vocab_zoo(tmp_path_factory) -> Path:
    """Three related models with different vocabularies: the base's 64 tokens; the same tokens
    in another order; and 2 tokens more (66), whose tokenizer also has a chat template."""
    root = tmp_path_factory.mktemp("vocab")
    write_model(root / "base", "mistral", 0.0)
    write_model(root / "reordered", "mistral", 0.02, vocab_words=WORDS[::-1])
    write_model(root / "extended", "mistral", 0.01, vocab_words=[*WORDS, "<bio>", "<cell>"])
    tokenizer = tiny_tokenizer([*WORDS, "<bio>", "<cell>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "extended")
    return root


def tokenizer_vocab(folder: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).get_vocab()


def by_token(ours: Path, theirs: Path, out: Path) -> Path:
    """mergekit's output with its vocabulary rows put in the order of our tokenizer's ids.

    mergekit appends a union's new tokens in the hash order of a vocabulary dict, which changes
    from run to run; mergelab in id order. What must agree is each token's row."""
    from safetensors.torch import save_file

    ours_vocab, theirs_vocab = tokenizer_vocab(ours), tokenizer_vocab(theirs)
    order = torch.arange(len(ours_vocab))
    for tok, i in ours_vocab.items():
        order[i] = theirs_vocab[tok]
    tensors = read(theirs)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = tensors[name]
        tensors[name] = torch.cat([rows[order], rows[len(order) :]])  # padding rows stay
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    return out


VOCAB_CONFIG = """\
models:
  - model: reordered
    parameters: {{weight: 0.6, density: 0.7}}
  - model: extended
    parameters: {{weight: 0.4, density: [0.5, 0.9]}}
merge_method: ties
base_model: base
dtype: float32
{tokenizer}
"""


@pytest.mark.parametrize(
    ("tokenizer", "n_rows"),
    [
        ("tokenizer_source: union", 66),
        ("tokenizer_source: base", 64),
        ("tokenizer_source: extended", 66),
        (
            "tokenizer:\n  source: union\n  pad_to_multiple_of: 8\n  tokens:\n"
            "    <bio>: {source: {kind: zero}}\n"
            "    w3: {source: extended, force: true}\n"
            "    <cell>: {source: {kind: model_token, model: base, token: w7}}",
            72,
        ),
    ],
    ids=["union", "base", "model", "tokens-block"],
)
def test_vocabularies_are_aligned_as_mergekit_does(
    vocab_zoo, tmp_path, monkeypatch, tokenizer, n_rows
):
    """Embedding and head rows follow the output tokenizer: same tensors as mergekit, same
    vocabulary, vocab_size in config.json, tokenizer files written."""
    config = place(vocab_zoo, VOCAB_CONFIG.format(tokenizer=tokenizer))
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    assert_same_model(ours, by_token(ours, theirs, tmp_path / "theirs-by-token"))
    assert read(ours)["model.embed_tokens.weight"].shape[0] == n_rows
    assert config_of(ours)["vocab_size"] == config_of(theirs)["vocab_size"] == n_rows
    assert sorted(tokenizer_vocab(ours)) == sorted(tokenizer_vocab(theirs))
    assert (ours / "tokenizer.json").is_file() and (ours / "tokenizer_config.json").is_file()
    marker = json.loads((ours / "mergelab_output.json").read_text())
    assert "tokenizer.json" in marker["entries"]


def test_different_vocabularies_without_a_tokenizer_source_are_refused(vocab_zoo, capsys):
    config = place(vocab_zoo, VOCAB_CONFIG.format(tokenizer=""))
    assert main(["merge", "--config", str(config), "--explain"]) == 2
    err = capsys.readouterr().err
    assert "model.embed_tokens.weight" in err and "need tokenizer_source" in err


@pytest.mark.parametrize(
    "lines", [f'tokenizer_source: base\nchat_template: "{TEMPLATE}"', "chat_template: auto"]
)
def test_chat_template_is_written_as_mergekit_writes_it(vocab_zoo, tmp_path, monkeypatch, lines):
    """A template given as text (with a tokenizer source), or "auto" (the template most input
    models carry, set on the base's tokenizer): mergekit's tokenizer and template."""
    if not (vocab_zoo / "chatty").exists():
        write_model(vocab_zoo / "chatty", "mistral", 0.02)
        tokenizer = tiny_tokenizer(WORDS)
        tokenizer.chat_template = TEMPLATE
        tokenizer.save_pretrained(vocab_zoo / "chatty")
    text = "models:\n  - model: chatty\n    parameters: {weight: 0.5}\nmerge_method: ties\n"
    config = place(vocab_zoo, text + f"base_model: base\ndtype: float32\n{lines}\n")
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    assert_same_model(ours, theirs)
    from transformers import AutoTokenizer

    ours_tok, theirs_tok = (AutoTokenizer.from_pretrained(f) for f in (ours, theirs))
    assert ours_tok.chat_template == theirs_tok.chat_template == TEMPLATE
    assert ours_tok.get_vocab() == theirs_tok.get_vocab()


# --- more of mergekit's spelling -----------------------------------------------------------

ORCA, PLATYPUS = "psmathur/orca_mini_v3_13b", "garage-bAInd/Platypus2-13B"
WIZARD, BASE = "WizardLM/WizardLM-13B-V1.2", "TheBloke/Llama-2-13B-fp16"
CONFIGS = {
    # mergekit's usual slerp style: the base listed among the models, a filtered gradient
    "slerp-base-among-models": f"""
models: [{{model: {ORCA}}}, {{model: {PLATYPUS}}}]
merge_method: slerp
base_model: {ORCA}
parameters:
  t: [{{filter: self_attn, value: [0, 0.5, 0.3, 0.7, 1]}}, {{filter: mlp, value: [1, 0, 0.5]}},
      {{value: 0.5}}]
dtype: float32
""",
    "dare_ties": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: 1.0, density: [0.9, 0.4]}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 0.5, density: 0.6}}}}
merge_method: dare_ties
base_model: {BASE}
parameters: {{normalize: true, lambda: 0.9}}
dtype: float32
""",
    "dare_linear": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: 0.7, density: 0.5}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 0.3, density: 0.8}}}}
merge_method: dare_linear
base_model: {BASE}
parameters: {{rescale: false}}
dtype: float32
""",
    "task_arithmetic": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: [1.0, 0.2]}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 0.5}}}}
merge_method: task_arithmetic
base_model: {BASE}
parameters: {{lambda: 1.3, normalize: true}}
dtype: float32
""",
    "breadcrumbs": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: 1.0, density: 0.8, gamma: 0.05}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 0.6, density: 0.9}}}}
merge_method: breadcrumbs
base_model: {BASE}
dtype: float32
""",
    "model_stock": f"""
models: [{{model: {ORCA}}}, {{model: {PLATYPUS}}}, {{model: {WIZARD}}}]
merge_method: model_stock
base_model: {BASE}
dtype: float32
""",
    # linear has no base in mergekit: a base_model is one more input, weighted like the others
    "linear-with-base": f"""
models: [{{model: {ORCA}, parameters: {{weight: 2}}}}, {{model: {PLATYPUS}}}]
merge_method: linear
base_model: {BASE}
parameters: {{weight: 0.5}}
dtype: float32
""",
    "out_dtype": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: 1.0, density: 0.5}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 1.0, density: 0.5}}}}
merge_method: ties
base_model: {BASE}
dtype: float32
out_dtype: bfloat16
""",
    # slices that merge: per-slice parameters and a slice's own base
    "sliced-slerp": f"""
slices:
  - sources:
      - {{model: {ORCA}, layer_range: [0, 2]}}
      - {{model: {PLATYPUS}, layer_range: [0, 2]}}
    parameters: {{t: [0.2, 0.8]}}
  - sources:
      - {{model: {ORCA}, layer_range: [1, 4]}}
      - {{model: {WIZARD}, layer_range: [1, 4]}}
    base_model: {WIZARD}
merge_method: slerp
base_model: {ORCA}
parameters: {{t: 0.3}}
dtype: float32
""",
    "nuslerp-no-base": f"""
models:
  - {{model: {ORCA}, parameters: {{weight: 0.3}}}}
  - {{model: {PLATYPUS}, parameters: {{weight: 0.7}}}}
merge_method: nuslerp
parameters: {{nuslerp_flatten: false}}
dtype: float32
""",
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mergekit_spelling_equals_mergekit(zoo, tmp_path, monkeypatch, name):
    config = place(zoo, CONFIGS[name])
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab", "--seed", str(SEED))
    assert_same_model(ours, theirs)
    for key in ("num_hidden_layers", "vocab_size"):
        assert config_of(ours)[key] == config_of(theirs)[key]


def test_without_dtype_the_stored_dtype_is_computed_and_kept(tmp_path, monkeypatch):
    for name, noise in (("base", 0.0), ("a", 0.02), ("b", 0.01)):
        write_model(tmp_path / name, "llama", noise, dtype=torch.bfloat16)
    text = "models: [{model: a, parameters: {weight: 0.7}}, {model: b, parameters: {weight: 0.3}}]"
    config = place(tmp_path, text + "\nmerge_method: linear\n")
    theirs = run_mergekit(config, tmp_path / "mergekit", monkeypatch)
    ours = run_mergelab(config, tmp_path / "mergelab")
    assert_same_model(ours, theirs)
    assert all(t.dtype == torch.bfloat16 for t in read(ours).values())
