"""The compiled loops (mergelab.merge.kernels, C) give the torch path's bits.

Every chunked method that has a compiled pass (linear, task arithmetic, TIES, DARE-linear,
DARE-TIES, breadcrumbs and the exact k-th largest |τ| behind TIES' and breadcrumbs' thresholds) is
run twice on the same inputs, once with the compiled loops and once with them turned off (the torch
code, which is also the fallback where the loops were not built), and the outputs must be equal bit for bit: stored
bfloat16, float16 and float32 inputs, bfloat16/float32/float16 outputs, one to three experts,
negative and zero weights, λ ≠ 1, both sign rules and every divisor, tensors over several chunks
with a partial last one, and inputs full of exact zeros, −0.0 and ties at the thresholds.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mergelab.merge import MergeInputError, TensorContext, get_merge_method
from mergelab.merge.accelerator import chunks, fast_paths, kernels, sampling, thresholds
from mergelab.merge.methods import steps
from mergelab.merge.registry import fast_path

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="the compiled loops were not built (no C compiler)"
)

# a chunk and a bit (two chunks, the second partial, ending in a partial tile), in rows of 67
ROW = 67
NUMEL = ROW * (chunks.CHUNK // ROW + 20)


def inputs(n_experts: int, dtype: torch.dtype, seed: int = 0, numel: int = NUMEL):
    """bf16-like weights with a sprinkling of exact zeros, −0.0 and repeated values."""
    g = torch.Generator().manual_seed(seed)
    base = 0.02 * torch.randn(numel, generator=g)
    experts = [base + 0.002 * torch.randn(numel, generator=g) for _ in range(n_experts)]
    zeros = torch.rand(numel, generator=g) < 0.01
    base[zeros] = -0.0
    for i, e in enumerate(experts):
        e[torch.rand(numel, generator=g) < 0.01] = 0.0
        e[zeros & (torch.rand(numel, generator=g) < 0.5)] = -0.0
        if i == 0:  # entries equal to the base: τ = ±0
            same = torch.rand(numel, generator=g) < 0.02
            e[same] = base[same]
    return base.to(dtype).view(-1, ROW), [e.to(dtype).view(-1, ROW) for e in experts]


def both_paths(monkeypatch, method: str, base, experts, params: dict, out_dtype=None, dtype=None):
    m = get_merge_method(method)
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)
        ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7)
        if out_dtype is not None:  # the streaming engine's way: stored dtype in, buffer out
            ctx.dtype = dtype or torch.float32
            ctx.out = torch.empty(experts[0].shape, dtype=out_dtype)
        results.append(m(base, experts, ctx=ctx, **params).clone())
    return results


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    same = a.view(bits) == b.view(bits)
    assert bool(same.all()), f"{int((~same).sum())} entries differ, first at {(~same).nonzero()[0]}"


@contextlib.contextmanager
def switched(name: str, on: bool):
    """One of the compiled loops' AVX2 switches (band_masks, vector_loops) on, where the CPU has
    AVX2, or off, restored after; nothing to switch without the compiled loops."""
    if not kernels.available():
        yield
        return
    before = getattr(kernels.loops(), name)(on)
    try:
        yield
    finally:
        getattr(kernels.loops(), name)(before)


# The two-expert bfloat16 loops run in AVX2 vectors (_loops.c, two_avx2) or one position at a
# time (two_loop), per `vector_loops`; the tests of those loops run both ways.
VECTORS = pytest.mark.parametrize("vectors", [True, False], ids=["vectors", "scalar"])


TIES = [
    {"density": 0.2, "trim_scope": "tensor"},
    {"density": [0.2, 0.5], "trim_scope": "tensor", "majority_sign": "count"},
    {
        "density": 0.2,
        "weight": [1.0, 0.5],
        "trim_scope": "tensor",
        "weighted_sign": True,
        "divide_by": "weight_sum",
    },
    {
        "density": [0.3, 0.9],
        "weight": [-0.7, 1.3],
        "trim_scope": "tensor",
        "weighted_sign": True,
        "majority_sign": "count",
        "divide_by": "weight_sum",
        "lambda_": 0.7,
    },
    {"density": 0.25, "weight": [0.0, 1.0], "trim_scope": "tensor", "divide_by": "weight_sum"},
    {"density": 0.4, "weight": [0.3, 2.0], "trim_scope": "tensor", "divide_by": "none"},
    {"density": 1.0, "trim_scope": "tensor", "lambda_": 1.5},
]


@VECTORS
@pytest.mark.parametrize("params", TIES, ids=range(len(TIES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_compiled_equals_torch(monkeypatch, params, dtype, vectors):
    base, experts = inputs(2, dtype)
    with switched("vector_loops", vectors):
        stored = both_paths(monkeypatch, "ties", base, experts, params, out_dtype=dtype)
    assert_same_bits(*stored)
    in_memory = both_paths(monkeypatch, "ties", base.float(), [e.float() for e in experts], params)
    assert_same_bits(*in_memory)
    # and the streamed (stored dtype) result is the in-memory one, rounded
    assert_same_bits(stored[0], in_memory[0].to(dtype))


@pytest.mark.parametrize("n_experts", [1, 3])
def test_ties_any_number_of_experts_and_other_dtypes(monkeypatch, n_experts):
    base, experts = inputs(n_experts, torch.float16, seed=n_experts)
    params = {"density": 0.3, "trim_scope": "tensor", "weight": [0.5, 1.0, 2.0][:n_experts]}
    for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert_same_bits(*both_paths(monkeypatch, "ties", base, experts, params, out_dtype))


def test_ties_whole_model_thresholds_compiled_equal_torch(monkeypatch):
    tensors = [inputs(2, torch.bfloat16, seed=s, numel=n) for s, n in [(1, NUMEL), (2, ROW * 75)]]
    found = []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)

        def make_iter():
            return ((f"t{i}", b, e) for i, (b, e) in enumerate(tensors))

        found.append(thresholds.global_magnitude_thresholds(make_iter, [0.2, 0.35], torch.float32))
    assert found[0] == found[1]
    assert all(0 < t < 1 for t in found[0])


@pytest.mark.parametrize("compiled", [True, False])
def test_whole_model_thresholds_fetching_ahead_are_the_same(monkeypatch, compiled):
    monkeypatch.setattr(kernels, "enabled", compiled)
    tensors = [inputs(2, torch.bfloat16, seed=s, numel=n) for s, n in [(3, NUMEL), (4, ROW * 75)]]
    tensors += [inputs(2, torch.bfloat16, seed=5, numel=ROW * 1500)]
    fetched = []

    def make_iter():  # fresh tensors on every yield, as memory maps are
        for i, (b, e) in enumerate(tensors):
            fetched.append(i)
            yield f"t{i}", b.clone(), [x.clone() for x in e]

    found = [
        thresholds.global_magnitude_thresholds(
            make_iter, [0.2, 0.35], torch.float32, fetch_ahead=ahead
        )
        for ahead in (False, True)
    ]
    assert found[0] == found[1]
    flat = [torch.cat([(e[i].float() - b.float()).view(-1) for b, e in tensors]) for i in range(2)]
    n = flat[0].numel()
    for x, density, threshold in zip(flat, [0.2, 0.35], found[1]):
        assert threshold == float(
            x.abs().sort(descending=True).values[steps.kept_count(density, n) - 1]
        )
    assert fetched == [0, 1, 2] * (len(fetched) // 3)


def test_pass_counts_move_to_int64_and_keep_every_count(monkeypatch):
    base, experts = inputs(2, torch.bfloat16, seed=6, numel=NUMEL)
    finders = [(0, 1, (None, 1 << 15, False)), (1, 4, (None, 1 << 15, False))]
    counted = []
    for widen_after in (kernels.WIDEN_ENTRIES, 1000):
        monkeypatch.setattr(kernels, "WIDEN_ENTRIES", widen_after)
        counter = kernels.TauHistograms(base, experts).pass_counts(finders)
        for part in chunks.chunks(NUMEL, NUMEL // 7):
            counter(part)
        counted.append([c.numpy().copy() for c in counter.totals()])
    for plain, widened in zip(*counted):
        assert widened.dtype == np.int64 and (plain == widened).all()
    assert counted[0][0].sum() == NUMEL


def test_start_chunks_returns_what_for_chunks_does():
    n = chunks.GRAIN * 9 + 5
    started = chunks.start_chunks(n, lambda part: (part.start, part.stop), chunks.GRAIN)
    assert started() == chunks.for_chunks(n, lambda part: (part.start, part.stop), chunks.GRAIN)
    assert started()[-1] == (chunks.GRAIN * 9, n)


DARE = [
    ("dare_linear", {"density": 0.2}),
    ("dare_linear", {"density": [0.3, 1.0], "weight": [0.6, -0.4], "normalize": True}),
    ("dare_linear", {"density": 0.5, "rescale": "none", "lambda_": 0.8}),
    ("dare_ties", {"density": 0.2}),
    ("dare_ties", {"density": [0.3, 0.6], "weight": [1.0, 0.7], "majority_sign": "count"}),
    (
        "dare_ties",
        {"density": 0.1, "weight": [1.0, 0.5], "weighted_sign": True, "divide_by": "none"},
    ),
]


@VECTORS
@pytest.mark.parametrize("method,params", DARE, ids=range(len(DARE)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dare_compiled_equals_torch(monkeypatch, method, params, dtype, vectors):
    base, experts = inputs(2, dtype, seed=3)
    with switched("vector_loops", vectors):
        stored = both_paths(monkeypatch, method, base, experts, params, out_dtype=dtype)
    assert_same_bits(*stored)
    in_memory = both_paths(monkeypatch, method, base.float(), [e.float() for e in experts], params)
    assert_same_bits(*in_memory)


# Every option set the two-expert bfloat16 loops are specialised for (_loops.c, two_loop_for):
# both sign rules, every divisor, weights all positive or not or all 1 (the "plain" loops), with
# and without DARE's drop.
ELECTIONS = [
    (method, {"majority_sign": sign, "divide_by": divide, "weight": weight, **drop})
    for method, drop in [
        ("ties", {"density": [0.3, 0.6], "trim_scope": "tensor"}),
        ("dare_ties", {"density": [0.3, 0.6]}),
        ("dare_ties", {"density": [1.0, 0.4]}),  # one expert drops, the other does not
    ]
    for sign in ("sum", "count")
    for divide in ("none", "count", "weight_sum")
    for weight in ([1.0, 0.5], [0.0, 1.5], [1.0, 1.0])
]


@VECTORS
@pytest.mark.parametrize("method,params", ELECTIONS, ids=range(len(ELECTIONS)))
def test_every_two_expert_election_loop_equals_torch(monkeypatch, method, params, vectors):
    base, experts = inputs(2, torch.bfloat16, seed=12)
    with switched("vector_loops", vectors):
        got = both_paths(monkeypatch, method, base, experts, params, torch.bfloat16)
    assert_same_bits(*got)


def test_vector_loops_equal_the_scalar_ones_at_every_length_and_value():
    """The AVX2 two-expert loops against two_loop, position by position, for every option set
    they cover (the sums with trim, band or drop, the plain elections with either sign rule and
    divisor, DARE's): lengths that end inside and at the end of a 16-entry step, NaN, ±Inf,
    ±0.0, experts exactly opposite (a tied vote) and sums past bfloat16's range. The output's
    bits and what the loop reported (ctx.checks) must be the same."""
    if not kernels.available():
        pytest.skip("the compiled loops are not built")
    plain = {"weight": [1.0, 1.0]}
    options = [
        ("dare_ties", {"density": [0.3, 0.6], "majority_sign": sign, "divide_by": d, **plain})
        for sign in ("sum", "count")
        for d in ("none", "count")
    ]
    options += [
        (
            "ties",
            {
                "density": 1.0,
                "trim_scope": "tensor",
                "majority_sign": sign,
                "divide_by": d,
                **plain,
            },
        )
        for sign in ("sum", "count")
        for d in ("none", "count")
    ]
    options += [
        ("dare_linear", {"density": 0.4}),
        ("dare_linear", {"density": 0.4, "normalize": True}),
        ("breadcrumbs", {"density": 0.9, "gamma": 0.1, "weight": [0.7, 1.2]}),
        ("breadcrumbs", {"density": 0.9, "gamma": 0.1, "normalize": True}),
    ]

    def merged(method, params, tensors, vectors):
        """The bfloat16 output and what the loop reported (None: nothing reached it)."""
        ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7, dtype=torch.float32)
        ctx.out = torch.empty(tensors[0].shape, dtype=torch.bfloat16)
        with contextlib.suppress(MergeInputError), switched("vector_loops", vectors):
            get_merge_method(method)(tensors[0], tensors[1:], ctx=ctx, **params)
        checks = ctx.checks
        return ctx.out, None if checks is None else (checks.inputs_finite, checks.result_finite)

    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38])
    for numel in (1, 15, 16, 17, 40, 67, 513):
        g = torch.Generator().manual_seed(numel)
        base = 0.02 * torch.randn(numel, generator=g)
        e0 = base + 0.002 * torch.randn(numel, generator=g)
        e1 = base + 0.002 * torch.randn(numel, generator=g)
        opposite = torch.rand(numel, generator=g) < 0.2  # tau_1 = -tau_0 exactly
        base[opposite] = 0.0
        e1[opposite] = -e0[opposite]
        for t in (base, e0, e1):
            where = torch.rand(numel, generator=g) < 0.1
            t[where] = special[torch.randint(len(special), (int(where.sum()),), generator=g)]
        tensors = [t.bfloat16() for t in (base, e0, e1)]
        for method, params in options:
            got = [merged(method, params, tensors, on) for on in (True, False)]
            assert_same_bits(got[0][0], got[1][0])
            assert got[0][1] == got[1][1], (method, params, numel)
    # one +Inf or NaN among negative entries (their sign bits set) is still seen, wherever it is
    method, params = options[0]
    for where in (0, 9, 16, 31, 36):
        for which in range(3):
            for bad in (float("inf"), float("nan")):
                tensors = [-(0.02 + 0.01 * torch.rand(40)) for _ in range(3)]
                tensors[which][where] = bad
                tensors = [t.bfloat16() for t in tensors]
                for on in (True, False):
                    _, checks = merged(method, params, tensors, on)
                    assert checks is not None and checks[0] is False


BREADCRUMBS = [
    {"density": 0.9, "gamma": 0.01},
    {"density": [0.5, 1.0], "gamma": [0.1, 0.0], "weight": [0.7, 1.2], "lambda_": 0.9},
    {"density": [1e-7, 0.6], "gamma": 0.2, "normalize": True, "weight": [1.0, 3.0]},
]


@VECTORS
@pytest.mark.parametrize("params", BREADCRUMBS, ids=range(len(BREADCRUMBS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_breadcrumbs_compiled_equals_torch(monkeypatch, params, dtype, vectors):
    base, experts = inputs(2, dtype, seed=4)
    with switched("vector_loops", vectors):
        got = both_paths(monkeypatch, "breadcrumbs", base, experts, params, dtype)
    assert_same_bits(*got)
    in_memory = [base.float(), [e.float() for e in experts]]
    assert_same_bits(*both_paths(monkeypatch, "breadcrumbs", *in_memory, params))


SUMS = [
    ("linear", {}),
    ("linear", {"weight": [0.3, 1.7], "normalize": False}),
    ("linear", {"weight": [2.0, -0.5]}),
    ("task_arithmetic", {}),
    ("task_arithmetic", {"weight": [0.6, -0.4], "lambda_": 0.7}),
    ("task_arithmetic", {"weight": [1.0, 0.5], "normalize": True, "lambda_": 1.3}),
]


@pytest.mark.parametrize("method,params", SUMS, ids=range(len(SUMS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_and_task_arithmetic_compiled_equal_torch(monkeypatch, method, params, dtype):
    base, experts = inputs(2, dtype, seed=9)
    if method == "linear":
        base = None
    stored = both_paths(monkeypatch, method, base, experts, params, out_dtype=dtype)
    assert_same_bits(*stored)
    as_float = None if base is None else base.float()
    in_memory = both_paths(monkeypatch, method, as_float, [e.float() for e in experts], params)
    assert_same_bits(*in_memory)
    assert_same_bits(stored[0], in_memory[0].to(dtype))


@pytest.mark.parametrize("n_experts", [1, 3])
def test_sums_any_number_of_experts_and_other_dtypes(monkeypatch, n_experts):
    base, experts = inputs(n_experts, torch.float16, seed=10 + n_experts)
    weight = [0.5, 1.0, 2.0][:n_experts]
    for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        for method, b in (("linear", None), ("task_arithmetic", base)):
            got = both_paths(monkeypatch, method, b, experts, {"weight": weight}, out_dtype)
            assert_same_bits(*got)


@VECTORS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_ties", "breadcrumbs"])
def test_loops_report_nonfinite_inputs_and_results(method, dtype, vectors):
    """What the loops saw (ctx.checks): NaN/Inf in any input, and a result that overflows to Inf
    (inputs finite), each found wherever it sits."""
    params = {"ties": TIES[0], "dare_ties": DARE[3][1], "breadcrumbs": BREADCRUMBS[0]}
    m = get_merge_method(method)
    base, experts = inputs(2, dtype, seed=12)

    def checks(b, e, out_dtype=dtype):
        ctx = TensorContext("t", seed=1, dtype=torch.float32)
        ctx.out = torch.empty(b.shape, dtype=out_dtype)
        # a non-finite result is refused, after
        with contextlib.suppress(MergeInputError), switched("vector_loops", vectors):
            m(b, e, ctx=ctx, **params.get(method, {}))
        assert ctx.checks is not None and ctx.checks.covers_inputs([b, *e])
        assert ctx.checks.covers_result(ctx.out)
        return ctx.checks.inputs_finite, ctx.checks.result_finite

    assert checks(base, experts) == (True, True)
    for which in range(3):
        for bad, where in (
            (float("nan"), NUMEL - 3),
            (float("inf"), NUMEL - 3),
            (-float("inf"), 21),
        ):
            b, e = base.clone(), [x.clone() for x in experts]
            target = b if which == 0 else e[which - 1]
            target.view(-1)[where] = bad
            assert checks(b, e)[0] is False
    if method == "task_arithmetic":  # finite inputs, a result beyond float16's range
        e = [x.clone() for x in experts]
        e[0].view(-1)[5] = 6e4 if dtype == torch.float32 else 3e38
        e[1].view(-1)[5] = 6e4 if dtype == torch.float32 else 3e38
        out_dtype = torch.float16 if dtype == torch.float32 else dtype
        assert checks(base, e, out_dtype) == (True, False)


def test_sfc64_streams_are_numpys():
    """Streams advanced DARE_LANES at a time in vector lanes, two groups of them, the last group
    partly filled: each stream is NumPy's SFC64 stream for its (seed, expert, block)."""
    keys = [(i, block) for block in range(5, 10) for i in range(2)]  # 10 streams: two groups
    lanes = kernels.DARE_LANES
    states = np.zeros((2, 4, lanes), dtype=np.uint64)
    for at, (i, block) in enumerate(keys):
        states[at // lanes, :, at % lanes] = kernels.sfc64_state(11, i, block)
    head = np.zeros((2 * lanes, 4), dtype=np.uint64)
    kernels.loops().sfc64_fill(states, head, 4)  # in three calls: the states carry over
    tail = np.zeros((2 * lanes, 6), dtype=np.uint64)  # rows longer than the steps asked
    kernels.loops().sfc64_fill(states, tail, 5)
    more = np.zeros((2 * lanes, 21), dtype=np.uint64)  # eight steps at a time, and the rest
    kernels.loops().sfc64_fill(states, more, 21)
    rows = np.concatenate([head, tail[:, :5], more], axis=1)
    for at, (i, block) in enumerate(keys):
        reference = np.random.SFC64(np.random.SeedSequence(11, spawn_key=(i, block)))
        assert rows[at].tolist() == reference.random_raw(30).tolist()


def test_bfloat16_rounding_is_torchs():
    """Round to nearest even, including halfway cases, infinities and the largest finites."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64)
    halfway = (bits & ~0xFFFF) | 0x8000
    x = torch.cat([bits, halfway]).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0])])
    params, scalars, flags = kernels.sum_plan([1.0], lambda_=1.0, normalize=False)
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    # θ_b + (θ_1 − θ_b) with θ_b = 0 reproduces x (but −0.0) exactly in float32, then rounds it
    kernels.ChunkMerger(torch.zeros_like(x), [x], out, params, scalars, flags)(slice(0, x.numel()))
    assert_same_bits(out, x.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kth_largest_tau_compiled_equals_torch_and_sort(monkeypatch, dtype):
    """Several ranks per expert (breadcrumbs' band), a sampled first pass and the exact passes."""
    base, experts = inputs(3, dtype, seed=5, numel=ROW * 16000)  # above SAMPLE_MIN_NUMEL
    numel = base.numel()
    ranks = [[1, numel // 5, numel], [numel // 100, numel // 2], [7]]
    found = []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)
        found.append(thresholds.tau_kth_largest_abs(base, experts, ranks, torch.float32))
    assert found[0] == found[1]
    for e, ks, values in zip(experts, ranks, found[0]):
        magnitudes = (e.float() - base.float()).abs().flatten().sort(descending=True).values
        assert values == [float(magnitudes[k - 1]) for k in ks]


def test_the_torch_path_runs_without_the_loops(monkeypatch):
    """MERGELAB_KERNELS=torch (or no compiled loops built): no compiled loop is called."""
    monkeypatch.setattr(kernels, "_extension", lambda: None)
    assert not kernels.available() and not kernels.active() and kernels.active_loops() is None

    def refuse() -> None:
        raise AssertionError("the compiled loops were used")

    monkeypatch.setattr(kernels, "loops", refuse)
    base, experts = inputs(2, torch.bfloat16, numel=ROW * 100)
    for method, params in [("ties", TIES[0]), *DARE[:1], ("breadcrumbs", BREADCRUMBS[0])]:
        get_merge_method(method)(base, experts, ctx=TensorContext("t"), **params)
    get_merge_method("task_arithmetic")(base, experts, ctx=TensorContext("t"))
    get_merge_method("linear")(None, experts, ctx=TensorContext("t"), weight=[1.0, 1.0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_histogram_passes_count_what_torch_counts(monkeypatch, dtype):
    """Same counts in every pass kind (sampled runs, top bits, a band), chunk by chunk."""
    base, experts = inputs(2, dtype, seed=6)
    part = slice(chunks.CHUNK, base.numel())  # a partial last chunk: a partial last run
    finders = [
        thresholds.KthLargestAbs(sampling.SAMPLE_STRIDE),
        thresholds.KthLargestAbs(1),
        thresholds.KthLargestAbs(1),
    ]
    finders[2]._mode, finders[2]._bucket, finders[2]._width = "band", 0x3A80, 3 << 16
    collecting = thresholds.KthLargestAbs(1)  # a binade around the median |τ|, its values kept
    tau = (experts[1].float() - base.float()).abs().view(-1)[part]
    middle = int(tau.median().view(torch.int32)) >> 16
    collecting._mode, collecting._bucket, collecting._width = "collect", middle - 64, 128 << 16
    counted = []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)
        count = thresholds._tau_histograms(base, experts, torch.float32)(
            [*finders, collecting], [1, 0, 1, 1]
        )
        per_chunk = count(part)
        # the compiled loops keep counts per worker thread, handed over once per pass
        counted.append(count.totals() if compiled else per_chunk)
    (ends_a, values_a), (ends_b, values_b) = counted[0].pop(), counted[1].pop()
    assert ends_a.tolist() == ends_b.tolist() and len(values_a) > tau.numel() // 10
    assert np.array_equal(np.sort(values_a), np.sort(values_b))
    for a, b in zip(*counted):  # torch's bincount stops at the highest bin it saw
        size = max(a.numel(), b.numel())
        a, b = a.long(), b.long()
        assert torch.equal(F.pad(a, (0, size - a.numel())), F.pad(b, (0, size - b.numel())))


@pytest.mark.parametrize("masks", [True, False], ids=["bit-masks", "byte-flags"])
def test_band_passes_alone_and_paired_count_what_torch_counts(monkeypatch, masks):
    """Histogram bands of bfloat16 inputs one, two, four and five buckets wide, alone and paired
    with another band of the same expert (one loop for both), and a collected band, on |τ| whose
    bit patterns end in 16 zero bits and on others: the same counts and kept values as
    torch's, whether the bands' entries are flagged in bit masks or bytes."""
    with switched("band_masks", masks):
        check_band_passes(monkeypatch)


def test_band_masks_flag_what_bytes_flag():
    """A band pass's bit masks (AVX2) and byte flags, alone and paired with another band of the
    same expert: the same counts and collected values on lengths that end inside a vector, a
    64-entry word and a tile, with NaN and Inf entries (counted above every band) and |τ| on
    the band's edges."""
    if not kernels.available():
        pytest.skip("the compiled loops are not built")
    for numel in (ROW, 15 * ROW, 16 * ROW, 61 * ROW):  # 67, 1005, 1072, 4087 entries
        base, (expert,) = inputs(1, torch.float32, seed=numel, numel=numel)
        base, expert = base.view(-1), expert.view(-1)
        expert[:: max(1, numel // 5)] = float("nan")
        expert[1 :: max(1, numel // 3)] = float("inf")
        base, expert = base.bfloat16(), expert.bfloat16()
        tau = (expert.float() - base.float()).abs()
        finite = tau[tau.isfinite()]
        edge = int(finite.median().view(torch.int32)) if finite.numel() else 0x3B000000
        collected = (0, 1, (edge - 1, 1 << 16, True))
        counted = (0, 1, (edge - 1 - (1 << 16), 1 << 17, False))
        for passes in ([collected, counted], [collected], [counted]):  # paired, then alone
            both = []
            for on in (True, False):
                with switched("band_masks", on):
                    histograms = kernels.TauHistograms(base, [expert])
                    both.append(histograms.count(slice(0, numel), passes))
            for (_, _, (_, _, collect)), a, b in zip(passes, *both):
                if collect:
                    (ends_a, values_a), (ends_b, values_b) = a, b
                    assert ends_a.tolist() == ends_b.tolist()
                    assert np.array_equal(np.sort(values_a), np.sort(values_b))
                    assert len(values_a) > 0
                else:
                    assert torch.equal(a, b)
                    assert int(a.sum()) == numel and int(a[-1]) > 0  # NaN and Inf above


def check_band_passes(monkeypatch):
    base, experts = inputs(2, torch.bfloat16, seed=12)
    tau = [(e.float() - base.float()).abs().view(-1) for e in experts]
    assert any(bool(((t.view(torch.int32) & 0xFFFF) != 0).any()) for t in tau)  # both kinds
    middle = [int(t.median().view(torch.int32)) >> 16 for t in tau]

    def band(
        expert: int, offset: int, buckets: int, mode: str = "band"
    ) -> thresholds.KthLargestAbs:
        finder = thresholds.KthLargestAbs(1)
        finder._mode, finder._bucket = mode, middle[expert] + offset
        finder._width = buckets << 16
        return finder

    passes = [
        (0, band(0, 0, 1)),  # alone
        (1, band(1, -2, 5)),  # paired
        (1, band(1, -1, 1)),
        (1, band(1, -1, 2)),  # paired
        (1, band(1, 1, 4)),
        (1, band(1, 0, 2, "collect")),  # alone, collected
    ]
    counted = []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)
        count = thresholds._tau_histograms(base, experts, torch.float32)(
            [f for _, f in passes], [e for e, _ in passes]
        )
        per_chunk = [count(part) for part in chunks.chunks(base.numel())]
        if compiled:
            counted.append(count.totals())
        else:
            totals = []
            for j in range(len(passes)):
                if j == len(passes) - 1:  # the collected band: its ends and its values
                    ends = sum(c[j][0] for c in per_chunk)
                    totals.append((ends, np.concatenate([c[j][1] for c in per_chunk])))
                else:
                    size = passes[j][1]._width + 2
                    totals.append(sum(F.pad(c[j], (0, size - c[j].numel())) for c in per_chunk))
            counted.append(totals)
    (ends_a, values_a), (ends_b, values_b) = counted[0].pop(), counted[1].pop()
    assert ends_a.tolist() == ends_b.tolist() and len(values_a) > 0
    assert np.array_equal(np.sort(values_a), np.sort(values_b))
    for a, b in zip(*counted):
        assert a.long().sum() == base.numel() and int(a[1:-1].sum()) > 0
        assert torch.equal(a.long(), b.long())


@pytest.mark.parametrize("bucket", [0x0000, 0x3B20, 0x7F7F])
def test_band_counts_at_the_ends_of_the_range(monkeypatch, bucket):
    """A band from the lowest bucket (0 and denormal |τ|), around the values, and one reaching
    the bit patterns of Inf and NaN (counted entry by entry), on inputs that hold Inf, NaN,
    huge values and exact zeros: the same counts as torch's."""
    base, (expert,) = inputs(1, torch.float32, seed=9)
    base, expert = base.view(-1).clone(), expert.view(-1).clone()
    g = torch.Generator().manual_seed(4)
    spots = torch.randint(0, base.numel(), (400,), generator=g)
    expert[spots[:100]] = float("inf")
    expert[spots[100:200]] = float("nan")
    expert[spots[200:300]] = 3e38 * torch.sign(torch.randn(100, generator=g))
    expert[spots[300:]] = base[spots[300:]] + 1e-42  # denormal τ
    finder, collecting = thresholds.KthLargestAbs(1), thresholds.KthLargestAbs(1)
    finder._mode, finder._bucket, finder._width = "band", bucket, 2 << 16
    collecting._mode, collecting._bucket, collecting._width = "collect", bucket, 2 << 16
    counted, collected = [], []
    for compiled in (True, False):
        monkeypatch.setattr(kernels, "enabled", compiled)
        count = thresholds._tau_histograms(base, [expert], torch.float32)(
            [finder, collecting], [0, 0]
        )
        per_chunk = [count(part) for part in chunks.chunks(base.numel())]
        if compiled:  # totals() adds the worker threads' arrays up: once
            histogram, kept = count.totals()
            counted.append(histogram.long())
            collected.append(kept)
        else:
            counted.append(sum(F.pad(c[0], (0, (2 << 16) + 2 - c[0].numel())) for c in per_chunk))
            collected.append(
                (sum(c[1][0] for c in per_chunk), np.concatenate([c[1][1] for c in per_chunk]))
            )
    assert torch.equal(counted[0], counted[1])
    for ends, values in collected:  # the band's values, kept: the histogram's counts
        assert ends.tolist() == [counted[0][0], counted[0][-1]]
        inside = torch.bincount(
            torch.from_numpy(values - ((bucket << 16) - 1)).long(), minlength=(2 << 16) + 2
        )
        assert torch.equal(inside[1:-1], counted[0][1:-1])


def test_dare_three_experts_compiled_equals_torch(monkeypatch):
    """Three streams per block, the blocks' streams advanced together in vector lanes."""
    base, experts = inputs(3, torch.bfloat16, seed=8)
    params = {"density": [0.2, 0.5, 0.7], "weight": [1.0, 0.5, 0.25]}
    for method in ("dare_linear", "dare_ties"):
        got = both_paths(monkeypatch, method, base, experts, params, out_dtype=torch.bfloat16)
        assert_same_bits(*got)


@pytest.mark.parametrize(
    "n_experts,density,blocks",
    [(2, [0.3, 0.6], 4), (3, [0.2, 1.0, 0.5], 3), (5, 0.4, 3)],  # 8, 6 and 15 streams a chunk
)
def test_dare_chunks_of_several_blocks_compiled_equal_torch(
    monkeypatch, n_experts, density, blocks
):
    """Chunks of several DARE blocks (their streams advanced together in the lanes of a vector,
    two vectors' worth with five experts), the last block partial and ending in a partial tile:
    the torch path's bits, whose masks NumPy draws block by block."""
    numel = ROW * (5 * steps.DARE_BLOCK // ROW + 33)  # five blocks and a bit
    monkeypatch.setattr(kernels, "dare_chunk", lambda numel, n: blocks * steps.DARE_BLOCK)
    base, experts = inputs(n_experts, torch.bfloat16, seed=9, numel=numel)
    for method in ("dare_linear", "dare_ties"):
        params = {"density": density}
        got = both_paths(monkeypatch, method, base, experts, params, out_dtype=torch.bfloat16)
        assert_same_bits(*got)


def test_dare_chunks_fill_the_lanes_and_leave_each_thread_work(monkeypatch):
    block = steps.DARE_BLOCK
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert kernels.dare_chunk(16 * block, 2) == 4 * block  # 8 streams: one vector
    assert kernels.dare_chunk(16 * block, 3) == 2 * block
    assert kernels.dare_chunk(4 * block, 2) == 2 * block  # two chunks, one per thread
    assert kernels.dare_chunk(3 * block, 2) == block
    assert kernels.dare_chunk(block // 2, 1) == block
    assert kernels.dare_chunk(16 * block, 9) == block
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernels.dare_chunk(16 * block, 1) == 8 * block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finiteness_check_compiled_equals_torch(monkeypatch, dtype):
    x = torch.randn(5000).to(dtype)
    assert kernels.all_finite_compiled(x) is True
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[4321] = bad
        assert kernels.all_finite_compiled(y) is False
        assert kernels.all_finite_chunk(y) is False
    monkeypatch.setattr(kernels, "enabled", False)
    assert kernels.all_finite_compiled(x) is None
    assert kernels.all_finite_compiled(torch.randn(10, dtype=torch.float16)) is None


def test_locate_compiled_equals_numpy(monkeypatch):
    """The bucket of the k-th largest and the rank inside it, found from the top by the compiled
    loop and by NumPy's cumulative sum, for sparse and dense histograms and every kind of k:
    the first, one inside a bucket, one at a bucket's edge, the last."""
    rng = np.random.default_rng(3)
    for bins in (1, 7, 1 << 15, (1 << 16) + 2):
        for density in (0.001, 0.5, 1.0):
            counts = rng.integers(1, 5, bins) * (rng.random(bins) < density)
            counts[rng.integers(bins)] += 1  # never empty
            counts = counts.astype(np.int64)
            total = int(counts.sum())
            edge = int(counts[::-1].cumsum()[min(2, bins - 1)])  # the last item of a bucket
            for k in sorted({1, max(1, total // 3), edge, total}):
                compiled = thresholds._locate(counts, k)
                with monkeypatch.context() as m:
                    m.setattr(kernels, "active_loops", lambda: None)  # the fallback _locate takes
                    assert compiled == thresholds._locate(counts, k), (bins, density, k)
                assert compiled == thresholds._locate_numpy(counts, k)


@pytest.mark.skipif(kernels.file_mapping() is None, reason="no mmap on this system")
def test_file_mapping_maps_the_files_bytes_read_only(tmp_path):
    """_loops.Mapping (what CheckpointFolder.map uses, without holding the GIL): the file's bytes
    from a page-aligned offset, read-only, with clear errors for bad arguments."""
    import mmap
    import os

    data = os.urandom(3 * mmap.ALLOCATIONGRANULARITY + 100)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    mapping = kernels.file_mapping()
    with open(path, "rb") as f:
        m = mapping(f.fileno(), mmap.ALLOCATIONGRANULARITY, len(data) - mmap.ALLOCATIONGRANULARITY)
        with pytest.raises(OSError):  # not a multiple of the page size
            mapping(f.fileno(), 1, 10)
        with pytest.raises(ValueError):
            mapping(f.fileno(), 0, 0)
    view = memoryview(m)  # the file is closed: the map stays valid
    assert view.readonly and bytes(view) == data[mmap.ALLOCATIONGRANULARITY :]
    assert m.address % mmap.ALLOCATIONGRANULARITY == 0
    with pytest.raises(TypeError):
        view[0] = 1
    with pytest.raises(OSError):
        mapping(-1, 0, 10)


# Half-precision compute (a mergekit config's `dtype: bfloat16`): mergekit's options (per-tensor
# trim, weighted sign, Σw divisor or none, DARE's L1 rescale) and others, in bfloat16 and float16.
HALF = [
    (
        "ties",
        {
            "density": 0.2,
            "weight": [1.0, 0.5],
            "trim_scope": "tensor",
            "weighted_sign": True,
            "divide_by": "weight_sum",
        },
    ),
    (
        "ties",
        {
            "density": [0.3, 0.9],
            "weight": [-0.7, 1.3],
            "trim_scope": "tensor",
            "majority_sign": "count",
            "divide_by": "none",
            "lambda_": 0.7,
        },
    ),
    ("ties", {"density": 1.0, "trim_scope": "tensor", "weighted_sign": True}),
    ("dare_ties", {"density": 0.2, "rescale": "l1", "weighted_sign": True, "divide_by": "none"}),
    (
        "dare_ties",
        {
            "density": [0.3, 1.0],
            "weight": [1.0, 0.5],
            "rescale": "l1",
            "weighted_sign": True,
            "divide_by": "weight_sum",
        },
    ),
    ("dare_ties", {"density": 0.5, "majority_sign": "count"}),
    ("dare_linear", {"density": 0.2, "rescale": "l1"}),
    ("dare_linear", {"density": [0.3, 0.7], "weight": [0.6, -0.4], "rescale": "none"}),
    ("dare_linear", {"density": 0.1, "normalize": True, "lambda_": 0.8}),
    ("breadcrumbs", {"density": 0.9, "gamma": 0.01}),
    ("breadcrumbs", {"density": [0.5, 1.0], "gamma": [0.1, 0.0], "weight": [0.7, 1.2]}),
]


@pytest.mark.parametrize("method,params", HALF, ids=[f"{m}{i}" for i, (m, _) in enumerate(HALF)])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_compute_equals_the_method(monkeypatch, method, params, compute):
    base, experts = inputs(2, torch.bfloat16, seed=21)  # two DARE blocks, the second partial
    stored = both_paths(
        monkeypatch, method, base, experts, params, out_dtype=torch.bfloat16, dtype=compute
    )
    assert_same_bits(*stored)
    cast = [base.to(compute), [e.to(compute) for e in experts]]
    in_memory = both_paths(monkeypatch, method, *cast, params)
    assert_same_bits(*in_memory)
    assert_same_bits(stored[0], in_memory[0].to(torch.bfloat16))
    # and the fast path took it, in its one compiled pass (it did not hand the tensor back to
    # the method, nor run the method's steps itself)
    monkeypatch.setattr(kernels, "enabled", True)
    passes = []
    merge_in_one_pass = kernels.half_merge
    monkeypatch.setattr(
        kernels,
        "half_merge",
        lambda *a, **k: passes.append(merge_in_one_pass(*a, **k)) or passes[-1],
    )
    m = get_merge_method(method)
    globals_, lists = m.resolve(2, params)
    ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7)
    assert fast_path(method).merge(*cast, ctx, {**globals_, **lists}) is not None
    assert passes == [True]


@pytest.mark.parametrize("method,params", HALF, ids=[f"{m}{i}" for i, (m, _) in enumerate(HALF)])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("where", ["base", "expert", "overflow"])
def test_half_precision_pass_declines_nan_and_inf(monkeypatch, method, params, compute, where):
    """A NaN in the base, an Inf in an expert, or finite inputs whose difference overflows the
    dtype: the compiled pass declines and the method's steps give the bits (torch's NaN rules;
    the result may still be finite, an Inf trimmed or outvoted)."""
    base, experts = inputs(2, torch.bfloat16, seed=22)
    base, experts = base.to(compute), [e.to(compute) for e in experts]
    big = torch.finfo(compute).max
    if where == "base":
        base[3, 5] = float("nan")
    elif where == "expert":
        experts[1][7, 1] = float("-inf")
    else:
        base[2, 2], experts[0][2, 2] = -big, big
    m = get_merge_method(method)
    globals_, lists = m.resolve(2, params)
    passes, results = [], []
    merge_in_one_pass = kernels.half_merge
    monkeypatch.setattr(
        kernels,
        "half_merge",
        lambda *a, **k: passes.append(merge_in_one_pass(*a, **k)) or passes[-1],
    )
    for compiled in (True, False):  # unchecked: the results hold NaN or Inf
        monkeypatch.setattr(kernels, "enabled", compiled)
        ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7)
        results.append(m.apply(base, experts, ctx, {**globals_, **lists}, check_finite=False))
    assert_same_bits(*results)
    assert True not in passes  # declined where it ran (DARE's drop pass may decline first)


def test_half_precision_thresholds_are_the_rounded_float32_ones():
    """torch forms a half-precision τ in float32 and rounds it, so the k-th largest |τ| in that
    dtype is the float32 one rounded (thresholds.tau_kth_largest_abs relies on it): equal to
    torch.kthvalue on the half τ, for every rank, with many zeros and ties."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1000, 300_001, 9_000_001):  # one compiled call; chunked passes
            base = (0.02 * torch.randn(n, generator=g)).to(dtype)
            experts = [
                (base.float() + s * torch.randn(n, generator=g)).to(dtype) for s in (2e-3, 5e-2)
            ]
            experts[0][: n // 3] = base[: n // 3]
            ks = [1, 2, n // 5, n // 2, n - 1, n]
            found = thresholds.tau_kth_largest_abs(base, experts, [ks, ks[:3]], dtype)
            for expert, wanted, got in zip(experts, [ks, ks[:3]], found):
                assert got == steps.kth_largest_abs_many(expert - base, wanted), (dtype, n)


# linear and task arithmetic in half precision: the fast path takes every weight and λ (the
# half-precision sum is steps.half_weighted_sum: each entry's bits depend on that entry alone),
# at every thread count the method's bits
HALF_SUMS = [
    ("linear", {"weight": [1.0, 1.0, 1.0]}, True),
    ("linear", {"weight": [1.0, 1.0, 1.0], "normalize": False}, True),
    ("linear", {"weight": [-0.6, 1.0, 1.0]}, True),  # negative, Σw = 1.4
    ("linear", {"weight": [0.3, 1.0, 1.0], "normalize": False}, True),
    ("linear", {"weight": [0.3, 0.7, 1.0]}, True),
    ("linear", {"weight": [0.3, -0.3, 1e-9]}, True),  # |Σw| < 1e-8: not divided
    ("task_arithmetic", {"weight": [1.0, 1.0, 1.0]}, True),
    ("task_arithmetic", {"weight": [2.5, 1.0, 1.0], "normalize": True}, True),
    ("task_arithmetic", {"weight": [-0.4, 1.0, 1.0], "normalize": True}, True),
    ("task_arithmetic", {"weight": [1.0, 1.0, 1.0], "lambda_": 0.8}, True),
    ("task_arithmetic", {"weight": [0.5, -0.3, 1.0], "normalize": True, "lambda_": 1.3}, True),
]


@pytest.mark.parametrize(
    "method,params,taken", HALF_SUMS, ids=[f"{m}{i}" for i, (m, _, _) in enumerate(HALF_SUMS)]
)
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_sums_equal_the_method(monkeypatch, method, params, taken, compute):
    base, experts = inputs(3, torch.bfloat16, seed=23)
    if method == "linear":
        base = None
    for threads in (1, 2):  # the fast path's chunks on every core, the method's torch threads
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            stored = both_paths(
                monkeypatch, method, base, experts, params, out_dtype=torch.bfloat16, dtype=compute
            )
            cast = [None if base is None else base.to(compute), [e.to(compute) for e in experts]]
            in_memory = both_paths(monkeypatch, method, *cast, params)
        finally:
            torch.set_num_threads(before)
        assert_same_bits(*stored)
        assert_same_bits(*in_memory)
        assert_same_bits(stored[0], in_memory[0].to(torch.bfloat16))
    monkeypatch.setattr(kernels, "enabled", True)
    m = get_merge_method(method)
    globals_, lists = m.resolve(3, params)
    ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7)
    got = fast_path(method).merge(*cast, ctx, {**globals_, **lists})
    assert (got is not None) == taken


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_sums_in_float32_out_equal_the_method(monkeypatch, dtype):
    """Stored float32, computed in half precision, stored back in float32 (the half result
    widened exactly), and a lone expert (only the method's ``mul``)."""
    base, experts = inputs(2, torch.float32, seed=24)
    for method, b, weight in (
        ("task_arithmetic", base, [0.7, 1.0]),
        ("linear", None, [1.0, 1.0]),
        ("linear", None, [-1.7]),
    ):
        xs = experts[: len(weight)]
        params = {"weight": weight}
        got = both_paths(monkeypatch, method, b, xs, params, out_dtype=torch.float32, dtype=dtype)
        assert_same_bits(*got)


@pytest.mark.parametrize("density", [0.2, 1e-7, 0.5, 0.9999999])
@pytest.mark.parametrize("numel", [1, 3, steps.DARE_BLOCK, 2 * steps.DARE_BLOCK + 5])
def test_dare_integer_masks_are_the_methods(density, numel):
    for expert in (0, 2):
        ours = fast_paths.dare_keep_mask(torch.Size([numel]), density, 11, expert)
        assert torch.equal(ours, steps.dare_keep_mask((numel,), density, 11, expert))


def test_dare_integer_masks_drop_an_entry_drawn_at_the_limit():
    """Densities whose limit is exactly an entry's draw u: that entry is dropped (u < limit),
    the case where an off-by-one in the integer comparison would show."""
    raw = np.random.SFC64(np.random.SeedSequence(11, spawn_key=(0, 0))).random_raw(4)
    drawn = raw.view(np.uint32) & ((1 << 23) - 1)
    for u in drawn[drawn > 0]:
        density = int(u) / (1 << 23)
        ours = fast_paths.dare_keep_mask(torch.Size([8]), density, 11, 0)
        assert torch.equal(ours, steps.dare_keep_mask((8,), density, 11, 0))
        assert not ours[int(np.flatnonzero(drawn == u)[0])]


def dare_task_vector(numel: int, dtype: torch.dtype, scale: float, seed: int = 3) -> torch.Tensor:
    """A task vector in ``dtype`` with exact zeros, −0.0 and, at small ``scale``, subnormals."""
    g = torch.Generator().manual_seed(seed)
    tau = scale * torch.randn(numel, generator=g)
    tau[torch.rand(numel, generator=g) < 0.02] = 0.0
    tau[torch.rand(numel, generator=g) < 0.02] = -0.0
    return tau.to(dtype)


@pytest.mark.parametrize("numel", [1000, 3 * steps.DARE_BLOCK + 12345])
@pytest.mark.parametrize("scale", [3e-3, 2e-7, 1e-12], ids=["normal", "subnormal", "tiny"])
@pytest.mark.parametrize("rescale", ["l1", "keep_rate", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_dare_drop_compiled_equals_the_method(dtype, rescale, scale, numel):
    """kernels.dare_drop_ (two compiled passes) gives steps.random_drop_'s bits with
    steps.dare_keep_mask's mask: every rescale, values from normal down to subnormal (float16)
    and a Σ|τ| under the L1 rescale's 1e-7 floor ("tiny": no rescale), several DARE blocks."""
    for density, expert in ((0.2, 0), (0.9, 1)):
        tau = dare_task_vector(numel, dtype, scale)
        ours, theirs = tau.clone(), tau.clone()
        assert kernels.dare_drop_(ours, density, 7, expert, rescale)
        keep = steps.dare_keep_mask(tau.shape, density, 7, expert)
        steps.random_drop_(theirs, keep, density, rescale)
        assert_same_bits(ours, theirs)


def exact_total(per_exponent: list[int]) -> int:
    """A per-exponent sum list's total, in units of the smallest subnormal (as
    steps.round_exact_sum reads it)."""
    return sum(s << (max(e, 1) - 1) for e, s in enumerate(per_exponent))


@pytest.mark.parametrize("spread", ["narrow", "wide"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_dare_counts_sums_are_exact(dtype, spread):
    """kernels.dare_counts' Σ|τ| and Σ kept |τ| equal the exact sums (steps'
    exact_sum_per_exponent of |τ| and of the kept |τ|), whichever way each tile is summed: as
    integers of its smallest exponent (tiles spanning few binades) or entry by entry (with
    "wide", bfloat16 tiles holding 1e30 next to 1e-30; float16 has no such span), over several
    DARE blocks and a tail; the keep bits are steps.dare_keep_mask's."""
    numel = 2 * steps.DARE_BLOCK + 4099
    tau = dare_task_vector(numel, torch.float32, 3e-3)
    if spread == "wide" and dtype == torch.bfloat16:
        tau[::5000] = 1e30
        tau[7::5000] = -1e-30
        tau[-3] = 1e-38  # a subnormal in the tail
    tau = tau.to(dtype)
    keep, every, kept = kernels.dare_counts(tau, 0.3, 7, 2)
    mask = steps.dare_keep_mask(tau.shape, 0.3, 7, 2)
    bits = np.unpackbits(keep, bitorder="little")[:numel].astype(bool)
    assert np.array_equal(bits, mask.numpy())
    assert exact_total(every) == exact_total(steps.exact_sum_per_exponent(tau.abs()))
    kept_tau = torch.where(mask, tau.abs(), torch.zeros_like(tau))
    assert exact_total(kept) == exact_total(steps.exact_sum_per_exponent(kept_tau))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_dare_counts_of_several_experts_equal_one_at_a_time(dtype):
    """kernels.dare_counts_many (the experts' tiles in turn, the base's read once) gives each
    expert what dare_counts gives it alone: its own stream (expert number, density), keep bits
    and exact sums; experts whose τ differ in scale, several DARE blocks and a tail."""
    base, experts = inputs(3, dtype, seed=5, numel=ROW * 7900)
    base = base.view(-1)
    experts = [e.view(-1) for e in experts]
    experts[1][::7] = 1e-3 * experts[1][::7]  # far from the base: larger τ
    indices, densities = [0, 2, 5], [0.2, 0.5, 0.9]
    together = kernels.dare_counts_many(base, experts, densities, 11, indices)
    for expert, density, index, (keep, every, kept) in zip(experts, densities, indices, together):
        alone_keep, alone_every, alone_kept = kernels.dare_counts(
            None, density, 11, index, inputs=(base, expert)
        )
        assert np.array_equal(keep, alone_keep)
        assert exact_total(every) == exact_total(alone_every)
        assert exact_total(kept) == exact_total(alone_kept)


@pytest.mark.parametrize("rescale", ["l1", "keep_rate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_dare_drop_from_the_inputs_equals_the_method(dtype, rescale):
    """Given base and expert, dare_drop_ writes τ = expert − base as steps.task_vectors does
    (large and tiny differences, equal entries, ±0) and then drops it as the method."""
    base, experts = inputs(1, dtype, seed=9, numel=ROW * 7900)  # two DARE blocks and a part
    base, expert = base.view(-1), experts[0].view(-1)
    expert[::101] = 1e-3 * expert[::101]  # far from the base: τ rounds
    ours = torch.empty_like(base)
    assert kernels.dare_drop_(ours, 0.3, 7, 1, rescale, inputs=(base, expert))
    theirs = steps.task_vectors(base, [expert])[0]
    steps.random_drop_(theirs, steps.dare_keep_mask(theirs.shape, 0.3, 7, 1), 0.3, rescale)
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dare_drop_hands_nonfinite_task_vectors_back(bad):
    """A NaN or an Inf in τ: dare_drop_ declines and leaves τ untouched (the method runs)."""
    tau = dare_task_vector(5000, torch.bfloat16, 3e-3)
    tau[1234] = bad
    before = tau.clone()
    assert not kernels.dare_drop_(tau, 0.3, 7, 0, "l1")
    assert torch.equal(tau.view(torch.int16), before.view(torch.int16))
