"""Streamed checkpoint merging: equal to the in-memory merge, loadable, and safe on bad input."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from mergelab.merge import (
    MergeInputError,
    get_merge_method,
    list_merge_methods,
    merge_method,
    merge_state_dicts,
    unregister_merge_method,
)
from mergelab.merge.accelerator import chunks, kernels, scheduler, thresholds
from mergelab.merge.checkpoint import (
    INDEX_NAME,
    CheckpointFolder,
    merge_checkpoints,
    plan_checkpoint_merge,
)
from mergelab.merge.registry import register_fast_path
from mergelab.outputs import MARKER_NAME, ForeignOutputError, OutputExistsError

needs_accelerator = pytest.mark.skipif(
    not kernels.active(),
    reason="tests the accelerator: built and not switched off (MERGELAB_ACCELERATOR=off)",
)


def tiny_config(vocab: int = 64, tie: bool = False) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def build_set(root: Path, *, dtype=torch.bfloat16, tie=False, shard="16KB", seed=0):
    """base + two experts (base + different noise), saved sharded; returns paths and state dicts."""
    torch.manual_seed(seed)
    config = tiny_config(tie=tie)
    base = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    paths, sds = [], []
    for i, name in enumerate(["base", "expert_0", "expert_1"]):
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
        g = torch.Generator().manual_seed(100 + i)
        sd = {
            k: (v.float() + (0.02 * torch.randn(v.shape, generator=g) if i else 0)).to(dtype)
            for k, v in base.state_dict().items()
        }
        model.load_state_dict(sd)
        model.save_pretrained(root / name, max_shard_size=shard)
        paths.append(root / name)
        sds.append({k: v.clone() for k, v in model.state_dict().items()})
    return paths, sds


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_set(tmp_path_factory.mktemp("ckpt"))


def stored_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    with CheckpointFolder(folder) as f:
        return {n: f.read(n).clone() for n in f.tensors}


# Parameters that make each registered method run on 2 experts; methods added later run with
# their defaults.
METHOD_PARAMS = {
    "linear": {"weights": [0.3, 0.7]},
    "task_arithmetic": {"weights": [0.5, 1.0], "params": {"lambda": 0.8}},
    "ties": {"params": {"density": 0.3}},
    "dare_ties": {"params": {"density": 0.5}, "seed": 3},
    "dare_linear": {"params": {"density": 0.5}, "seed": 3},
    "breadcrumbs": {},
    "slerp": {"params": {"t": 0.3}, "base": False},  # slerp: two experts, no base
    "passthrough": {"base": False},  # copies one model: no base
}


@pytest.mark.parametrize("method", list_merge_methods())
def test_streamed_merge_equals_in_memory_merge(ckpts, tmp_path, method):
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    kwargs = dict(METHOD_PARAMS.get(method, {}))
    if not kwargs.pop("base", True):
        base, base_sd = None, None
    n = get_merge_method(method).n_experts[1] or 2  # nearswap, arcee_fusion, passthrough: 1
    expected = merge_state_dicts(method, base_sd, [sd0, sd1][:n], **kwargs)
    out = merge_checkpoints(
        method, base, [e0, e1][:n], output=tmp_path / "out", progress=False, **kwargs
    )
    got = stored_state_dict(out)
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype
        assert torch.equal(got[name], expected[name]), f"{method}: {name} differs"


def test_methods_without_base_stream_too(ckpts, tmp_path):
    """slerp of two experts and linear without a base: the first model gives config/tokenizer."""
    (_, e0, e1), (_, sd0, sd1) = ckpts
    for method, params in [("slerp", {"t": 0.3}), ("linear", {})]:
        expected = merge_state_dicts(method, None, [sd0, sd1], params=params)
        out = merge_checkpoints(
            method, None, [e0, e1], output=tmp_path / method, params=params, progress=False
        )
        got = stored_state_dict(out)
        assert all(torch.equal(got[n], expected[n]) for n in expected), method


@pytest.mark.parametrize("trim_scope", ["model", "tensor"])
def test_ties_whole_model_and_per_tensor_trim_equal_in_memory(ckpts, tmp_path, trim_scope):
    """TIES with one whole-model threshold (two streamed passes) or per-tensor thresholds."""
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    params = {"density": [0.2, 0.4], "trim_scope": trim_scope}
    expected = merge_state_dicts("ties", base_sd, [sd0, sd1], params=params)
    out = tmp_path / "o"
    merge_checkpoints("ties", base, [e0, e1], output=out, params=params, progress=False)
    got = stored_state_dict(out)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_two_pass_prepare_streams_inputs_again(ckpts, tmp_path):
    """A method with a whole-model first pass gets make_iter(); it may stream the inputs twice."""
    passes = []

    def prepare(params, make_iter):
        # pass 1: largest |task vector| entry over the model; pass 2: count entries above half it
        top = max(float((torch.stack(es) - b).abs().max()) for _, b, es in make_iter())
        passes.append(1)
        above = sum(int(((torch.stack(es) - b).abs() > top / 2).sum()) for _, b, es in make_iter())
        passes.append(2)
        return {"clip": top / 2, "count": above}

    @merge_method("test_global_clip", prepare=prepare, replace=True)
    def global_clip(base, experts, *, weight, ctx):
        tv = torch.stack(experts) - base
        return base + tv.clamp(-ctx.stats["clip"], ctx.stats["clip"]).mean(0)

    try:
        (base, e0, e1), (base_sd, sd0, sd1) = ckpts
        out = merge_checkpoints(
            "test_global_clip", base, [e0, e1], output=tmp_path / "o", progress=False
        )
        assert passes == [1, 2]
        floats = [n for n, v in base_sd.items() if v.is_floating_point()]
        clip = (
            max(
                float((torch.stack([sd0[n], sd1[n]]).float() - base_sd[n].float()).abs().max())
                for n in floats
            )
            / 2
        )
        got = stored_state_dict(out)
        for n in floats:
            b = base_sd[n].float()
            tv = torch.stack([sd0[n].float(), sd1[n].float()]) - b
            expected = (b + tv.clamp(-clip, clip).mean(0)).to(base_sd[n].dtype)
            assert torch.equal(got[n], expected), n
    finally:
        unregister_merge_method("test_global_clip")


def test_output_loads_with_automodel_and_matches(ckpts, tmp_path):
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    out = merge_checkpoints(
        "task_arithmetic",
        base,
        [e0, e1],
        output=tmp_path / "merged",
        weights=[1.0, 0.5],
        shard_size=10_000,  # tiny shards: many files
        progress=False,
    )
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # each shard respects the size bound unless one tensor alone exceeds it
        tensors = load_file(s)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 10_000 or len(tensors) == 1
    for name in ("config.json", "generation_config.json"):
        assert (out / name).is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = merge_state_dicts("task_arithmetic", base_sd, [sd0, sd1], weights=[1.0, 0.5])
    assert model.dtype == torch.bfloat16
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


def test_tied_embeddings(tmp_path):
    (base, e0, e1), (base_sd, sd0, sd1) = build_set(tmp_path / "in", tie=True, dtype=torch.float32)
    with CheckpointFolder(base) as f:
        assert "lm_head.weight" not in f.tensors  # transformers stores a tied head once
    out = merge_checkpoints("linear", base, [e0, e1], output=tmp_path / "o", progress=False)
    with CheckpointFolder(out) as f:
        assert "lm_head.weight" not in f.tensors
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = merge_state_dicts("linear", base_sd, [sd0, sd1])
    assert torch.equal(model.lm_head.weight, expected["model.embed_tokens.weight"])


def test_tied_versus_untied_is_refused(tmp_path):
    (base, e0, _), _ = build_set(tmp_path / "a", tie=True, dtype=torch.float32)
    (_, u0, _), _ = build_set(tmp_path / "b", tie=False, dtype=torch.float32)
    with pytest.raises(MergeInputError, match="tie_word_embeddings"):
        plan_checkpoint_merge("linear", base, [e0, u0])


def rewrite_tensor(folder: Path, name: str, fn) -> None:
    """Replace (or with fn returning None, drop) one stored tensor, keeping the index right."""
    index_path = folder / INDEX_NAME
    index = json.loads(index_path.read_text())
    file = folder / index["weight_map"][name]
    tensors = load_file(file)
    new = fn(tensors[name])
    if new is None:
        del tensors[name]
        del index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, file, metadata={"format": "pt"})


def copy_set(ckpts, tmp_path) -> list[Path]:
    paths = []
    for p in ckpts[0]:
        shutil.copytree(p, tmp_path / p.name)
        paths.append(tmp_path / p.name)
    return paths


def assert_nothing_left(parent: Path, output_name: str) -> None:
    leftovers = [p.name for p in parent.iterdir() if output_name in p.name]
    assert leftovers == [], leftovers


def test_shape_mismatch_names_tensor_and_model(ckpts, tmp_path):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    rewrite_tensor(e1, "model.layers.1.mlp.up_proj.weight", lambda t: t[:-1].clone())
    with pytest.raises(MergeInputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model 1"):
        merge_checkpoints("linear", base, [e0, e1], output=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_missing_tensor_is_refused(ckpts, tmp_path):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    rewrite_tensor(e0, "model.norm.weight", lambda t: None)
    with pytest.raises(
        MergeInputError, match=r"model 0.*missing tensors \['model\.norm\.weight'\]"
    ):
        merge_checkpoints("task_arithmetic", base, [e0, e1], output=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_dtype_mismatch_is_refused(ckpts, tmp_path):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    rewrite_tensor(e0, "model.norm.weight", lambda t: t.float())
    with pytest.raises(MergeInputError, match=r"model\.norm\.weight.*float32"):
        plan_checkpoint_merge("task_arithmetic", base, [e0, e1])


@pytest.mark.parametrize(
    "method,params",
    [
        ("task_arithmetic", {}),
        ("linear", {}),
        ("ties", {"density": 0.2, "trim_scope": "tensor"}),
        ("dare_ties", {"density": 0.1}),  # the poisoned entry is most likely dropped
        ("breadcrumbs", {}),
    ],
)
@pytest.mark.parametrize("compiled", [True, False])
def test_nan_is_found_while_streaming_and_nothing_is_left(
    ckpts, tmp_path, monkeypatch, method, params, compiled
):
    """NaN/Inf in any input names the model, whether the compiled loop saw it (and kept or
    dropped the entry) or the torch path's pass over the inputs did."""
    monkeypatch.setattr(kernels, "enabled", compiled)
    base, e0, e1 = copy_set(ckpts, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(value):
        def rewrite(t):
            t = t.clone()
            t[3, 4] = value
            return t

        return rewrite

    rewrite_tensor(e1, name, poison(float("nan")))
    with pytest.raises(MergeInputError, match=rf"{name}.*model 1.*NaN"):
        merge_checkpoints(
            method, base, [e0, e1], output=tmp_path / "out", progress=False, params=params
        )
    assert_nothing_left(tmp_path, "out")
    if method != "linear":  # the base is an input too
        rewrite_tensor(e1, name, poison(0.0))
        rewrite_tensor(base, name, poison(float("inf")))
        with pytest.raises(MergeInputError, match=rf"{name}.*base.*NaN or Inf"):
            merge_checkpoints(
                method, base, [e0, e1], output=tmp_path / "out", progress=False, params=params
            )
        assert_nothing_left(tmp_path, "out")


def test_truncated_and_missing_shards_name_the_file(ckpts, tmp_path):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    shard = sorted(e0.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(MergeInputError, match=rf"{shard.name}.*(truncated|unreadable)"):
        merge_checkpoints("linear", base, [e0, e1], output=tmp_path / "o")
    other = sorted(e1.glob("model-*.safetensors"))[0]
    other.unlink()
    with pytest.raises(MergeInputError, match=rf"{other.name}.*missing"):
        plan_checkpoint_merge("linear", base, [e1])
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force_and_output_inside_input_is_refused(ckpts, tmp_path):
    (base, e0, e1), _ = ckpts
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(OutputExistsError):
        merge_checkpoints("linear", base, [e0, e1], output=out, progress=False)
    # --force replaces only an empty folder or a previous mergelab output, never user files
    with pytest.raises(ForeignOutputError, match=r"1 entry mergelab did not write: keep\.txt"):
        merge_checkpoints("linear", base, [e0, e1], output=out, force=True, progress=False)
    assert (out / "keep.txt").read_text() == "user data" and len(list(out.iterdir())) == 1
    (out / "keep.txt").unlink()
    merge_checkpoints("linear", base, [e0, e1], output=out, force=True, progress=False)
    assert (out / INDEX_NAME).is_file() and (out / MARKER_NAME).is_file()
    merge_checkpoints("task_arithmetic", base, [e0, e1], output=out, force=True, progress=False)
    assert json.loads((out / "mergelab_merge.json").read_text())["method"] == "task_arithmetic"
    assert_nothing_left(tmp_path, ".merged")
    with pytest.raises(ValueError, match="overlaps input"):
        merge_checkpoints("linear", base, [e0, e1], output=e0 / "sub", progress=False)


def test_interrupted_merge_leaves_no_finished_looking_folder(ckpts, tmp_path, monkeypatch):
    (base, e0, e1), _ = ckpts
    from mergelab.merge import checkpoint

    calls = []
    original = checkpoint.CheckpointMergePlan.merge_tensor

    def interrupt(self, t, phase=None):
        calls.append(t.name)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return original(self, t, phase)

    monkeypatch.setattr(checkpoint.CheckpointMergePlan, "merge_tensor", interrupt)
    with pytest.raises(KeyboardInterrupt):
        merge_checkpoints("linear", base, [e0, e1], output=tmp_path / "out", progress=False)
    assert_nothing_left(tmp_path, "out")


def test_vocab_padding_rule(tmp_path):
    """Base with 8 padded vocabulary rows, experts without: error by default; 'truncate' merges
    the 64 common rows and keeps the base's extra rows."""
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(tiny_config(vocab=64)).eval()
    big = AutoModelForCausalLM.from_config(tiny_config(vocab=72)).eval()
    sd_big = big.state_dict()
    sds = []
    for i, name in enumerate(["e0", "e1"]):
        sd = {k: v + 0.01 * (i + 1) for k, v in small.state_dict().items()}
        small.load_state_dict(sd)
        small.save_pretrained(tmp_path / name)
        sds.append(sd)
    big.save_pretrained(tmp_path / "base")
    paths = [tmp_path / "e0", tmp_path / "e1"]
    with pytest.raises(MergeInputError, match=r"vocab_size.*72.*64.*vocab_padding='truncate'"):
        merge_checkpoints("task_arithmetic", tmp_path / "base", paths, output=tmp_path / "o")
    out = merge_checkpoints(
        "task_arithmetic",
        tmp_path / "base",
        paths,
        output=tmp_path / "o",
        vocab_padding="truncate",
        progress=False,
    )
    got = stored_state_dict(out)
    cut = {k: (v[:64] if v.shape[0] == 72 else v) for k, v in sd_big.items()}
    expected = merge_state_dicts("task_arithmetic", cut, sds)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert got[name].shape == (72, 32)
        assert torch.equal(got[name][:64], expected[name])
        assert torch.equal(got[name][64:], sd_big[name][64:])
    assert torch.equal(got["model.norm.weight"], expected["model.norm.weight"])
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 72


def test_out_dtype_is_stored_and_recorded(ckpts, tmp_path):
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    out = merge_checkpoints(
        "linear", base, [e0, e1], output=tmp_path / "o", out_dtype=torch.float32, progress=False
    )
    got = stored_state_dict(out)
    assert all(t.dtype == torch.float32 for t in got.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    stacked = torch.stack([sd0["model.norm.weight"].float(), sd1["model.norm.weight"].float()])
    torch.testing.assert_close(got["model.norm.weight"], stacked.mean(0), rtol=1e-6, atol=1e-7)
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["method"] == "linear" and record["seed"] == 0


@pytest.mark.parametrize("prefetch_max_bytes", [0, 20_000])
def test_read_ahead_on_or_off_gives_the_same_merge(
    ckpts, tmp_path, monkeypatch, prefetch_max_bytes
):
    """No read-ahead at all, or only for some tensors."""
    monkeypatch.setattr(scheduler, "PREFETCH_MAX_BYTES", prefetch_max_bytes)
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    params = {"density": 0.3, "trim_scope": "tensor"}
    expected = merge_state_dicts("ties", base_sd, [sd0, sd1], params=params)
    out = merge_checkpoints(
        "ties", base, [e0, e1], output=tmp_path / "o", params=params, progress=False
    )
    got = stored_state_dict(out)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_merge_record_holds_absolute_input_paths(ckpts, tmp_path, monkeypatch):
    (base, e0, e1), _ = ckpts
    monkeypatch.chdir(base.parent)
    out = merge_checkpoints(
        "linear", "base", ["expert_0", "expert_1"], output=tmp_path / "o", progress=False
    )
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["base"] == str(base.resolve())
    assert record["models"] == [str(e0.resolve()), str(e1.resolve())]
    assert record["as_given"] == {"base": "base", "models": ["expert_0", "expert_1"]}


@pytest.mark.parametrize(
    "entry",
    ["../expert_0/{shard}", "{abs_other}", "sub/../../expert_0/{shard}", "link/{shard}"],
)
def test_index_may_not_point_outside_the_model_folder(ckpts, tmp_path, entry):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    index_path = e1 / INDEX_NAME
    index = json.loads(index_path.read_text())
    name, shard = next(iter(index["weight_map"].items()))
    (e1 / "link").symlink_to(e0)  # a folder link that leads out of the model folder
    bad = entry.format(shard=shard, abs_other=str(e0 / shard))
    index["weight_map"][name] = bad
    index_path.write_text(json.dumps(index))
    with pytest.raises(MergeInputError, match=rf"{INDEX_NAME}: entry '{name}' .*outside"):
        plan_checkpoint_merge("linear", base, [e0, e1])


def test_index_shard_linked_out_of_the_folder_is_refused_except_hub_cache_blobs(ckpts, tmp_path):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    shard = sorted(e1.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(MergeInputError, match=rf"{shard.name}.* resolves to .*outside"):
        plan_checkpoint_merge("linear", base, [e0, e1])
    # The Hugging Face hub cache: snapshots/<rev>/ holds links to ../../blobs/<hash>.
    repo = tmp_path / "models--x--y"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    shutil.copytree(e0, snapshot)
    for f in snapshot.glob("model-*.safetensors"):
        blob = repo / "blobs" / f"hash-{f.name}"
        shutil.move(f, blob)
        f.symlink_to(os.path.relpath(blob, f.parent))
    plan_checkpoint_merge("linear", base, [snapshot]).close()


@pytest.mark.parametrize("weight_map", [[["a", "b"]], "x", None])
def test_index_weight_map_of_the_wrong_type_names_the_file(ckpts, tmp_path, weight_map):
    base, e0, e1 = copy_set(ckpts, tmp_path)
    (e1 / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MergeInputError, match=rf"{e1 / INDEX_NAME}: 'weight_map' must map"):
        plan_checkpoint_merge("linear", base, [e0, e1])
    (e1 / INDEX_NAME).write_text("[1, 2]")
    with pytest.raises(MergeInputError, match="'weight_map' must map"):
        plan_checkpoint_merge("linear", base, [e0, e1])


def test_disk_full_mid_merge_keeps_the_previous_output(ckpts, tmp_path, monkeypatch):
    (base, e0, e1), _ = ckpts
    out = merge_checkpoints("linear", base, [e0, e1], output=tmp_path / "o", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from mergelab.merge import checkpoint

    calls = []
    real_write = checkpoint.ShardWriter.write

    def write(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, name, tensor)

    monkeypatch.setattr(checkpoint.ShardWriter, "write", write)
    with pytest.raises(OSError, match="could not write .*No space left") as info:
        merge_checkpoints("task_arithmetic", base, [e0, e1], output=out, force=True, progress=False)
    assert info.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_nothing_left(tmp_path, ".o.")


@pytest.mark.parametrize("size", [0, -1, "0GB", "-5MB", "infGB", "nanMB", True, "lots"])
def test_shard_sizes_must_be_positive_sizes(size):
    from mergelab.merge.checkpoint import parse_size

    with pytest.raises(ValueError, match="size"):
        parse_size(size)
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1KiB") == 1024 and parse_size(7) == 7


@pytest.fixture
def torch_threads():
    """Set torch's thread count for one test (the suite runs on one): ``torch_threads(n)``."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def merge_in_turn(monkeypatch) -> None:
    """Make the engine merge every tensor on every core in its turn (as without the output's
    phases) instead of whole tensors ahead on the chunk workers."""
    from mergelab.merge import checkpoint

    monkeypatch.setattr(checkpoint.CheckpointMergePlan, "expect_phases", lambda self, p: None)


@needs_accelerator
@pytest.mark.parametrize(
    "method,params",
    [("ties", {"density": 0.3, "trim_scope": "tensor"}), ("breadcrumbs", {"density": 0.5})],
)
@pytest.mark.parametrize("threads,whole", [(1, True), (2, True), (2, False)])
def test_per_tensor_thresholds_are_computed_once_per_tensor(
    ckpts, tmp_path, monkeypatch, torch_threads, threads, whole, method, params
):
    """TIES' and breadcrumbs' per-tensor passes run once per tensor, and the merge is the
    in-memory one: with two threads on the chunk worker that merges the tensor whole (its
    other tensors on the other worker), or, when tensors are merged in turn on every core, in
    the engine's reader thread for the tensors it reads ahead; never there on one thread (the
    reader would be a second core working)."""
    import threading

    torch_threads(threads)
    if not whole:
        merge_in_turn(monkeypatch)

    calls: list[tuple[int, str]] = []
    real = thresholds.tau_kth_largest_abs

    def counted(base, experts, ranks, dtype=None):
        calls.append((base.numel(), threading.current_thread().name))
        return real(base, experts, ranks, dtype)

    monkeypatch.setattr(thresholds, "tau_kth_largest_abs", counted)
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    out = merge_checkpoints(
        method, base, [e0, e1], output=tmp_path / "o", params=params, progress=False
    )
    floating = [n for n, v in base_sd.items() if v.is_floating_point()]
    assert len(calls) == len(floating)  # once per tensor (the merge used what was computed ahead)
    on_reader = [thread.startswith("mergelab-reader") for _, thread in calls]
    on_workers = {thread for _, thread in calls if thread.startswith("mergelab-chunks")}
    if threads == 1:
        assert not any(on_reader) and not on_workers
    elif whole:
        assert not any(on_reader) and len(on_workers) == 2
    else:
        assert any(on_reader)
    monkeypatch.setattr(thresholds, "tau_kth_largest_abs", real)
    expected = merge_state_dicts(method, base_sd, [sd0, sd1], params=params)
    got = stored_state_dict(out)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


@needs_accelerator
@pytest.mark.parametrize(
    "method,params",
    [
        ("linear", {}),
        ("task_arithmetic", {"lambda": 0.8}),
        ("ties", {"density": 0.3, "trim_scope": "tensor"}),
        ("ties", {"density": 0.3}),  # whole-model trim: its passes first, then the merge
        ("dare_ties", {"density": 0.5}),
        ("breadcrumbs", {"density": 0.5}),
    ],
)
def test_whole_tensors_ahead_give_the_merge_in_turn(
    ckpts, tmp_path, monkeypatch, torch_threads, method, params
):
    """Two threads: tensors merged whole on the chunk workers, several at once (and the
    largest, here those over 1/64 of all entries, in their turn on every core) store what
    merging each in turn stores, and what the in-memory engine computes, bit for bit."""

    torch_threads(2)
    monkeypatch.setattr(scheduler, "WHOLE_SHARE", 32)
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    merged_by: list[int] = []
    real = scheduler.LookAhead._merge_one

    def spy(self, index, phase, ahead):
        merged_by.append(index)
        return real(self, index, phase, ahead)

    monkeypatch.setattr(scheduler.LookAhead, "_merge_one", spy)
    whole = stored_state_dict(
        merge_checkpoints(
            method, base, [e0, e1], output=tmp_path / "a", params=params, seed=3, progress=False
        )
    )
    assert sorted(merged_by) == list(range(len(whole)))  # every tensor, once
    merge_in_turn(monkeypatch)
    in_turn = stored_state_dict(
        merge_checkpoints(
            method, base, [e0, e1], output=tmp_path / "b", params=params, seed=3, progress=False
        )
    )
    expected = merge_state_dicts(method, base_sd, [sd0, sd1], params=params, seed=3)
    assert whole.keys() == in_turn.keys()
    assert all(torch.equal(whole[n], in_turn[n]) for n in whole)
    assert all(torch.equal(whole[n], expected[n]) for n in expected)


@needs_accelerator
def test_whole_tensors_ahead_large_ones_in_turn(ckpts, monkeypatch, torch_threads):
    """Which tensors the engine merges ahead on one worker each: all but those holding more
    than 1/(WHOLE_SHARE · threads) of the model's entries (merged in their turn on every
    core), whatever their order."""
    from concurrent.futures import Future

    torch_threads(2)
    monkeypatch.setattr(scheduler, "WHOLE_SHARE", 32)
    (base, e0, e1), _ = ckpts
    plan = plan_checkpoint_merge("linear", base, [e0, e1])
    try:
        sizes = [math.prod(t.shape) for t in plan.tensors]
        large = {i for i, n in enumerate(sizes) if 64 * n > sum(sizes)}
        assert large and len(large) < len(sizes)
        assert any(i + 1 in large for i in large) and 0 in large  # in a row, and first
        submitted: list[int] = []

        def fake_merge(self, index, phase, ahead):
            return index

        monkeypatch.setattr(scheduler.LookAhead, "_merge_one", fake_merge)

        class Inline:
            def submit(self, fn, *args):
                submitted.append(args[0])
                future: Future = Future()
                future.set_result(fn(*args))
                return future

        monkeypatch.setattr(chunks, "chunk_workers", lambda: Inline())
        plan.expect_phases([0] * len(plan.tensors))
        got = [plan.merge_tensor(t, 0) for t in plan.tensors]
        assert got == list(range(len(sizes)))
        assert sorted(submitted) == sorted(set(range(len(sizes))) - large)
    finally:
        plan.close()


def test_whole_tensors_ahead_nan_names_its_tensor_and_nothing_is_left(
    ckpts, tmp_path, torch_threads
):
    """With tensors merged ahead, NaN in one is still reported for that tensor (in order:
    the tensors before it were fine), and the output folder never appears."""
    torch_threads(2)
    base, e0, e1 = copy_set(ckpts, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t):
        t = t.clone()
        t[5, 6] = float("nan")
        return t

    rewrite_tensor(e0, name, poison)
    with pytest.raises(MergeInputError, match=rf"{name}.*model 0.*NaN"):
        merge_checkpoints(
            "ties",
            base,
            [e0, e1],
            output=tmp_path / "out",
            progress=False,
            params={"density": 0.3, "trim_scope": "tensor"},
        )
    assert_nothing_left(tmp_path, "out")


@needs_accelerator
def test_an_ahead_hook_is_only_a_shortcut(ckpts, tmp_path, torch_threads):
    """A fast path's ``ahead`` statistics reach the method in ctx.stats; a hook that fails leaves
    the method to compute them itself, with the same result."""
    torch_threads(2)
    seen: list[bool] = []

    def ahead(base, experts, ctx, params):
        if params["fail"]:
            raise RuntimeError("not now")
        return {"mean_tau": (experts[0].float() - base.float()).mean().item()}

    @merge_method("ahead_probe", per_model=())
    def ahead_probe(base, experts, *, fail: bool = False, ctx):
        seen.append("mean_tau" in ctx.stats)
        mean = ctx.stats.get("mean_tau")
        if mean is None:
            mean = (experts[0] - base).mean().item()
        return base + mean

    # a fast path that only computes statistics ahead (its merge declines every tensor)
    register_fast_path("ahead_probe", lambda *args: None, ahead=ahead)

    try:
        (base, e0, _), _ = ckpts
        outputs = []
        for fail in (False, True):
            seen.clear()
            out = merge_checkpoints(
                "ahead_probe",
                base,
                [e0],
                output=tmp_path / f"o{fail}",
                params={"fail": fail},
                progress=False,
            )
            assert any(seen) != fail and (all(seen) or fail)
            outputs.append(stored_state_dict(out))
        assert all(torch.equal(outputs[0][n], outputs[1][n]) for n in outputs[0])
    finally:
        unregister_merge_method("ahead_probe")


def test_thresholds_for_other_ranks_are_not_used(ckpts):
    """ctx.stats entries computed for other ranks than the method needs are ignored."""
    from mergelab.merge import TensorContext
    from mergelab.merge.accelerator.fast_paths import TAU_KTH as _TAU_KTH

    _, (base_sd, sd0, sd1) = ckpts
    name = "model.layers.0.mlp.up_proj.weight"
    base, experts = base_sd[name].float(), [sd0[name].float(), sd1[name].float()]
    ties = get_merge_method("ties")
    params = {"density": 0.3, "trim_scope": "tensor"}
    plain = ties(base, experts, ctx=TensorContext(name), **params)
    stale = TensorContext(name, stats={_TAU_KTH: ([[1], [1]], [[0.0], [0.0]])})
    assert torch.equal(ties(base, experts, ctx=stale, **params), plain)


def test_whole_tensors_called_out_of_order_are_merged_in_turn(ckpts, torch_threads):
    """merge_tensor called out of plan order (not what write_sharded does): nothing merged
    ahead is handed out for the wrong tensor; from then on each is merged in its turn."""
    torch_threads(2)
    (base, e0, e1), (base_sd, sd0, sd1) = ckpts
    params = {"density": 0.3, "trim_scope": "tensor"}
    expected = merge_state_dicts("ties", base_sd, [sd0, sd1], params=params)
    plan = plan_checkpoint_merge("ties", base, [e0, e1], params=params)
    try:
        plan.expect_phases([0] * len(plan.tensors))
        order = [0, 1, 3, 2, *range(4, len(plan.tensors))]
        for i in order:
            t = plan.tensors[i]
            assert torch.equal(plan.merge_tensor(t, 0), expected[t.name])
    finally:
        plan.close()
