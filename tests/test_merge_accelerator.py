"""The accelerator on and off: the same merged bits, end to end through the streaming engine.

tests/test_merge_kernels.py pins each compiled loop to the plain torch method tensor by tensor;
here whole checkpoint folders are merged both ways, for every accelerated method, both stored
dtypes and the options the loops specialise on, with two threads (so the engine merges tensors
ahead on its workers) and with tensors large enough for the sampled threshold passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergelab.merge import accelerator
from mergelab.merge.accelerator import kernels, sampling
from mergelab.merge.accelerator.io import DirectIO, DirectStream
from mergelab.merge.checkpoint import FileStream, PlainIO, merge_checkpoints, output_io
from mergelab.merge.methods import standard, steps
from mergelab.merge.registry import fast_path

needs_loops = pytest.mark.skipif(not kernels.available(), reason="the compiled loops are not built")

# one tensor above the size from which thresholds are found by a sampled pass
SHAPES = {
    "model.embed_tokens.weight": (1024, 640),
    "model.layers.0.mlp.up_proj.weight": (96, 640),
    "model.norm.weight": (640,),
}
CASES = [
    ("linear", {"weights": [0.3, 0.7]}),
    ("task_arithmetic", {"weights": [0.5, 1.0], "params": {"lambda": 0.8, "normalize": True}}),
    ("ties", {"params": {"density": 0.3}}),
    ("ties", {"params": {"density": [0.2, 0.6], "trim_scope": "tensor", "majority_sign": "count"}}),
    (
        "ties",
        {
            "weights": [0.7, -0.4],
            "params": {"density": 0.5, "weighted_sign": True, "divide_by": "weight_sum"},
        },
    ),
    ("dare_linear", {"params": {"density": 0.4, "lambda": 0.9}, "seed": 3}),
    ("dare_ties", {"params": {"density": [0.3, 1.0], "rescale": "none"}, "seed": 5}),
    ("breadcrumbs", {"weights": [1.0, 0.5], "params": {"density": 0.8, "gamma": 0.05}}),
]


def write_set(root: Path, dtype: torch.dtype) -> list[Path]:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024}
    g = torch.Generator().manual_seed(0)
    base = {n: 0.02 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    folders = []
    for i, name in enumerate(["base", "expert_0", "expert_1"]):
        tensors = {
            n: (t + (0.002 * torch.randn(t.shape, generator=g) if i else 0))
            for n, t in base.items()
        }
        folder = root / name
        folder.mkdir()
        save_file(
            {n: t.to(dtype).contiguous() for n, t in tensors.items()}, folder / "model.safetensors"
        )
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


@needs_loops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_every_accelerated_method_writes_the_same_bits_on_and_off(tmp_path, monkeypatch, dtype):
    assert max(map(lambda s: torch.Size(s).numel(), SHAPES.values())) >= sampling.SAMPLE_MIN_NUMEL
    base, *experts = write_set(tmp_path, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for k, (method, options) in enumerate(CASES):
            outputs = []
            for on in (True, False):
                monkeypatch.setattr(kernels, "enabled", on)
                assert (fast_path(method) is not None) == on
                out = tmp_path / f"{k}-{on}"
                merge_checkpoints(method, base, experts, output=out, progress=False, **options)
                outputs.append(load_file(out / "model-00001-of-00001.safetensors"))
            on, off = outputs
            for name in SHAPES:
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                same = on[name].view(bits) == off[name].view(bits)
                assert bool(same.all()), f"{method} {options}: {name} differs"
    finally:
        torch.set_num_threads(before)


def test_one_setting_switches_the_accelerator(monkeypatch):
    monkeypatch.setattr(kernels, "enabled", True)
    accelerator.set_enabled(False)
    assert not accelerator.enabled() and fast_path("ties") is None
    accelerator.set_enabled(True)
    assert accelerator.enabled() == accelerator.available()
    assert (fast_path("ties") is not None) == accelerator.available()
    assert fast_path("slerp") is None  # a method without a fast path


def test_the_output_io_follows_the_switch(monkeypatch):
    monkeypatch.setattr(kernels, "enabled", False)
    assert output_io() is PlainIO
    monkeypatch.setattr(kernels, "enabled", True)
    assert output_io() is (DirectIO if accelerator.available() else PlainIO)


@needs_loops
def test_the_shards_have_the_same_bytes_on_and_off(tmp_path, monkeypatch):
    """On, the shards are written by the accelerator's O_DIRECT stream; off, by the engine's
    ordinary writes: the same files, byte for byte."""
    base, *experts = write_set(tmp_path, torch.bfloat16)
    opened: list[str] = []
    for stream in (FileStream, DirectStream):
        init = stream.__init__

        def spy(self, path, *args, _init=init, _name=stream.__name__, **kwargs):
            opened.append(_name)
            _init(self, path, *args, **kwargs)

        monkeypatch.setattr(stream, "__init__", spy)
    files = []
    for on in (True, False):
        monkeypatch.setattr(kernels, "enabled", on)
        out = tmp_path / f"ties-{on}"
        merge_checkpoints("ties", base, experts, output=out, progress=False, shard_size="1MB")
        shards = sorted(out.glob("*.safetensors"))
        assert len(shards) > 1
        files.append({p.name: p.read_bytes() for p in shards})
        assert set(opened) == {"DirectStream" if on else "FileStream"}
        opened.clear()
    assert files[0] == files[1]


def test_the_environment_switches_it_off():
    env = {**os.environ, "MERGELAB_ACCELERATOR": "off", "PYTHONPATH": str(Path.cwd())}
    code = "from mergelab.merge import accelerator; print(accelerator.enabled())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize("numel", [1000, steps.DARE_BLOCK, 3 * steps.DARE_BLOCK + 12345])
def test_l1_norm_does_not_depend_on_the_thread_count(numel):
    """Σ|x| in fixed blocks, each summed on one thread: one thread, two or four give the same
    bits, those of the blocks summed one by one on one thread."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.01
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        blocks = [
            x[s : s + steps.DARE_BLOCK].abs().sum() for s in range(0, numel, steps.DARE_BLOCK)
        ]
        expected = torch.stack(blocks).sum()
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            assert steps.l1_norm(x).item() == expected.item(), n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_exact_l1_norm_is_the_exact_sum_rounded_once(dtype):
    """Σ|x| exactly (fractions), rounded to the nearest value of x's dtype: neither neighbour of
    exact_l1_norm's result is nearer; values from subnormal to large, zeros, −0.0."""
    g = torch.Generator().manual_seed(5)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.finfo(dtype).bits // 8]
    for exponent in (-9, -6, -2, 1):
        x = (torch.randn(1500, generator=g, dtype=torch.float64) * 10.0**exponent).to(dtype)
        x[::37] = -0.0
        got = steps.exact_l1_norm(x)
        assert got.dtype == dtype and got.dim() == 0
        exact = sum((Fraction(v) for v in x.abs().double().tolist()), Fraction(0))
        error = abs(Fraction(got.item()) - exact)
        for step in (1, -1):
            neighbour = (got.view(bits) + step).view(dtype).item()
            if neighbour != neighbour:  # below +0.0: the bits of a NaN
                continue
            assert abs(Fraction(neighbour) - exact) >= error, (exponent, step)


def test_exact_l1_norm_at_the_ends_of_the_range():
    half = torch.float16
    assert steps.exact_l1_norm(torch.tensor([65504.0, 65504.0], dtype=half)).item() == float("inf")
    subnormals = torch.tensor([6e-8, -6e-8, 1e-7], dtype=half)  # 2⁻²⁴, −2⁻²⁴, 2·2⁻²⁴
    assert steps.exact_l1_norm(subnormals).item() == 4 * 2.0**-24
    assert steps.exact_l1_norm(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)).isinf()
    assert steps.exact_l1_norm(torch.tensor([float("nan"), 1.0])).isnan()
    assert steps.exact_l1_norm(torch.zeros(0, dtype=torch.bfloat16)).item() == 0.0


@pytest.mark.parametrize("numel", [1000, 3 * steps.DARE_BLOCK + 12345])
def test_exact_l1_norm_does_not_depend_on_the_thread_count(numel):
    """One thread, two or four give the same bits (the sum is exact, then rounded once)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.01
    before = torch.get_num_threads()
    try:
        found = set()
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            found |= {steps.exact_l1_norm(x).item(), steps.exact_l1_norm(x.bfloat16()).item()}
        assert len(found) == 2
    finally:
        torch.set_num_threads(before)


# A mergekit config's semantics (per-tensor trim, weighted sign, Σw divisor, DARE's L1 rescale),
# and TIES' whole-model trim, computed in half precision
HALF_CASES = [
    (
        "ties",
        {
            "weights": [1.0, 0.5],
            "params": {
                "density": 0.2,
                "trim_scope": "tensor",
                "weighted_sign": True,
                "divide_by": "weight_sum",
            },
        },
    ),
    ("ties", {"params": {"density": [0.3, 0.5]}}),
    (
        "dare_ties",
        {"params": {"density": 0.2, "rescale": "l1", "weighted_sign": True}, "seed": 4},
    ),
    ("dare_linear", {"params": {"density": [0.3, 1.0], "rescale": "l1"}, "seed": 6}),
    ("breadcrumbs", {"params": {"density": 0.9, "gamma": 0.01}}),
]


def refuse(*args, **kwargs):
    raise AssertionError("the method ran where its fast path should have")


def assert_on_and_off_write_the_same_bits(
    tmp_path, monkeypatch, cases, base, experts, stored, compute, step
):
    """Each (method, options) of ``cases`` merged from the checkpoints with the accelerator on
    and off, at two torch threads: the same stored bits in every tensor. On, ``step`` (a
    ``standard`` attribute only the method itself calls) refuses to run: the fast path takes
    every tensor."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for k, (method, options) in enumerate(cases):
            outputs = []
            for on in (True, False):
                monkeypatch.setattr(kernels, "enabled", on)
                monkeypatch.setattr(standard, step, refuse if on else getattr(steps, step))
                out = tmp_path / f"{k}-{on}"
                base_ = None if method == "linear" else base
                merge_checkpoints(
                    method, base_, experts, output=out, progress=False, dtype=compute, **options
                )
                outputs.append(load_file(out / "model-00001-of-00001.safetensors"))
            on, off = outputs
            for name in SHAPES:
                assert on[name].dtype == off[name].dtype == stored
                bits = torch.int16 if stored == torch.bfloat16 else torch.int32
                same = on[name].view(bits) == off[name].view(bits)
                assert bool(same.all()), f"{method} {options}: {name} differs"
    finally:
        torch.set_num_threads(before)


@needs_loops
@pytest.mark.parametrize(
    "stored,compute",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16-in-bf16", "f32-in-f16"],
)
def test_half_precision_compute_writes_the_same_bits_on_and_off(
    tmp_path, monkeypatch, stored, compute
):
    base, *experts = write_set(tmp_path, stored)
    assert_on_and_off_write_the_same_bits(
        tmp_path, monkeypatch, HALF_CASES, base, experts, stored, compute, "task_vectors"
    )


# linear and task arithmetic in half precision: the fast path takes every weight and λ
# (steps.half_weighted_sum is a function of each entry alone)
HALF_SUM_CASES = [
    ("linear", {"weights": [1.0, 1.0]}),
    ("linear", {"weights": [-0.5, 1.0], "params": {"normalize": False}}),
    ("task_arithmetic", {"weights": [1.0, 1.0]}),
    ("task_arithmetic", {"weights": [0.3, 1.0], "params": {"normalize": True}}),
    ("task_arithmetic", {"weights": [0.3, 0.7], "params": {"lambda": 0.8}}),
]


@needs_loops
@pytest.mark.parametrize(
    "stored,compute",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16-in-bf16", "f32-in-f16"],
)
def test_half_precision_sums_write_the_same_bits_on_and_off(tmp_path, monkeypatch, stored, compute):
    base, *experts = write_set(tmp_path, stored)
    assert_on_and_off_write_the_same_bits(
        tmp_path, monkeypatch, HALF_SUM_CASES, base, experts, stored, compute, "weighted_sum"
    )


@needs_loops
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mergekit_configs_of_sums_write_the_same_bits_on_and_off(tmp_path, monkeypatch, dtype):
    """mergekit-dialect configs at a half dtype: linear (float32 inside, rounded once) and
    task_arithmetic (the half dtype throughout), accelerator on and off."""
    from mergelab.cli import main

    base, *experts = write_set(tmp_path, torch.bfloat16)
    configs = {
        "linear": "normalize: true",
        "task_arithmetic": "normalize: false",
        "task_arithmetic_normalized": "normalize: true",
        "task_arithmetic_lambda": "lambda: 0.8",
    }
    weights = ([1.0, 1.0], [0.4, 1.0], [-0.7, 1.3])
    for name, params in configs.items():
        for w in weights:
            # linear's float32 loop takes every weight; the half one alpha-1 adds only
            taken = name == "linear" or ("lambda" not in params and w[1] == 1)
            method = "linear" if name == "linear" else "task_arithmetic"
            lines = [f"merge_method: {method}", f"dtype: {dtype}", f"parameters: {{{params}}}"]
            if method == "task_arithmetic":
                lines.append(f"base_model: {base}")
            lines.append("models:")
            for e, x in zip(experts, w):
                lines += [f"  - model: {e}", f"    parameters: {{weight: {x}}}"]
            config = tmp_path / f"{name}-{w}.yml"
            config.write_text("\n".join(lines) + "\n")
            outputs = []
            for on in (True, False):
                monkeypatch.setattr(kernels, "enabled", on)
                refused = on and taken  # the method must not run
                monkeypatch.setattr(
                    standard, "weighted_sum", refuse if refused else steps.weighted_sum
                )
                out = tmp_path / f"{name}-{w}-{on}"
                args = ["merge", "--config", str(config), "--out", str(out), "--no-progress"]
                assert main(args) == 0
                outputs.append(load_file(out / "model-00001-of-00001.safetensors"))
            on, off = outputs
            for tensor in SHAPES:
                assert on[tensor].dtype == getattr(torch, dtype)
                same = on[tensor].view(torch.int16) == off[tensor].view(torch.int16)
                assert bool(same.all()), f"{name} {w}: {tensor} differs"


@needs_loops
@pytest.mark.parametrize("dtype,streamed", [("bfloat16", True), ("float16", False)])
def test_a_mergekit_config_at_the_stored_dtype_streams_the_stored_inputs(
    tmp_path, monkeypatch, dtype, streamed
):
    """``dtype:`` equal to every input's stored dtype rounds nothing, so the stored tensors go to
    the fast paths as they are (no cast copies); another dtype casts them first. Same bits either
    way as with the accelerator off (the tests above)."""
    from mergelab.cli import main
    from mergelab.merge.checkpoint import CheckpointMergePlan

    base, *experts = write_set(tmp_path, torch.bfloat16)
    seen: dict[str, bool] = {}
    original = CheckpointMergePlan.streams_stored

    def record(self, name):
        seen[name] = original(self, name)
        return seen[name]

    monkeypatch.setattr(CheckpointMergePlan, "streams_stored", record)
    config = tmp_path / "ties.yml"
    lines = ["merge_method: ties", f"dtype: {dtype}", f"base_model: {base}", "models:"]
    for e in experts:
        lines += [f"  - model: {e}", "    parameters: {weight: 0.5, density: 0.5}"]
    config.write_text("\n".join(lines) + "\n")
    assert main(["merge", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    assert set(SHAPES) <= set(seen)
    assert {seen[name] for name in SHAPES} == {streamed}
