"""The merge-method registry: adding a method with one decorated function, and clear errors."""

from __future__ import annotations

import pytest
import torch

from mergelab.merge import (
    MergeInputError,
    TensorContext,
    UnknownMergeMethodError,
    get_merge_method,
    list_merge_methods,
    merge_method,
    merge_models,
    merge_state_dicts,
    unregister_merge_method,
)
from mergelab.merge.methods.steps import task_vectors


@pytest.fixture
def median_method():
    """README "Adding a merge method": the worked example, registered for one test at a time."""

    @merge_method("median_task_vector", per_model=())
    def median_task_vector(base, experts, *, lambda_: float = 1.0, ctx):
        """θ_b + λ · median_i τ_i, element-wise: one outlying expert cannot drag the merge."""
        return base + lambda_ * task_vectors(base, experts).median(dim=0).values

    yield median_task_vector
    unregister_merge_method("median_task_vector")


def test_worked_example_runs_end_to_end(median_method):
    torch.manual_seed(0)
    base = torch.nn.Linear(4, 3)
    experts = [torch.nn.Linear(4, 3) for _ in range(3)]
    merged = merge_models("median_task_vector", base, experts, params={"lambda": 0.5})

    assert "median_task_vector" in list_merge_methods()
    for name, b in base.state_dict().items():
        taus = torch.stack([e.state_dict()[name] - b for e in experts])
        expected = b + 0.5 * taus.median(dim=0).values
        torch.testing.assert_close(merged.state_dict()[name], expected, rtol=0, atol=0)
    assert not merged.training
    # The docstring is the method's documentation; the signature declares its parameters.
    m = get_merge_method("median_task_vector")
    assert m.global_defaults == {"lambda_": 1.0} and m.per_model == ()
    assert "median" in m.doc


def test_unknown_method_names_the_registered_ones():
    with pytest.raises(UnknownMergeMethodError, match="unknown merge method 'tie'.*ties"):
        merge_state_dicts("tie", {"w": torch.zeros(2)}, [{"w": torch.ones(2)}])
    with pytest.raises(KeyError):  # still a KeyError for code that catches one
        get_merge_method("tie")


@pytest.mark.parametrize(
    ("method", "params", "message"),
    [
        (
            "ties",
            {"densty": 0.2},
            r"no parameter\(s\) \['densty'\].*per-model: \['weight', 'density'\]",
        ),
        ("ties", {"trim_scope": "layer"}, "trim_scope='layer' is not one of 'model', 'tensor'"),
        ("ties", {"density": 1.5}, r"density must lie in \(0, 1\], got 1.5"),
        ("ties", {"weighted_sign": "yes"}, "weighted_sign='yes' should be true or false"),
        ("ties", {"lambda": "one"}, "'ties': lambda must be a number, got 'one'"),
        ("dare_ties", {"rescale": "l2"}, "rescale='l2' is not one of"),
        ("linear", {"weight": [1.0]}, "weight has 1 values for 2 experts"),
        ("model_stock", {"weight": 1.0}, r"no parameter\(s\) \['weight'\]"),
    ],
)
def test_bad_parameters_fail_before_any_tensor_is_merged(method, params, message):
    base = {"w": torch.zeros(3)}
    experts = [{"w": torch.ones(3)}, {"w": -torch.ones(3)}]
    with pytest.raises(ValueError, match=message):
        merge_state_dicts(method, base, experts, params=params)


def test_per_model_parameter_given_per_expert_or_once():
    base = {"w": torch.zeros(4)}
    experts = [{"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}, {"w": torch.tensor([4.0, 3.0, 2.0, 1.0])}]
    a = merge_state_dicts("linear", base, experts, per_model_params={"weight": [1.0, 3.0]})
    b = merge_state_dicts("linear", base, experts, weights=[1.0, 3.0])
    c = merge_state_dicts("linear", base, experts, params={"weight": 2.0})
    torch.testing.assert_close(a["w"], b["w"])
    torch.testing.assert_close(a["w"], torch.tensor([3.25, 2.75, 2.25, 1.75]))
    torch.testing.assert_close(c["w"], torch.full((4,), 2.5))


def test_method_needs_a_base():
    with pytest.raises(ValueError, match="'ties' needs a base model"):
        merge_state_dicts("ties", None, [{"w": torch.ones(2)}])


def test_registration_errors():
    with pytest.raises(ValueError, match="already registered"):
        merge_method("linear")(lambda base, experts, *, weight, ctx: base)

    def no_ctx(base, experts, *, weight):
        return base

    def positional(base, experts, scale=1.0, *, weight, ctx):
        return base

    def no_default(base, experts, *, weight, scale, ctx):
        return base

    with pytest.raises(TypeError, match=r"takes \(base, experts, \*, \.\.\., ctx\)"):
        merge_method("x1")(no_ctx)
    with pytest.raises(TypeError, match="'scale' must be keyword-only"):
        merge_method("x2")(positional)
    with pytest.raises(TypeError, match="'scale' needs a default"):
        merge_method("x3")(no_default)
    assert not {"x1", "x2", "x3"} & set(list_merge_methods())


def test_a_method_returning_the_wrong_shape_is_caught():
    @merge_method("broken_shape", per_model=())
    def broken_shape(base, experts, *, ctx):
        return base.reshape(-1)[:1]

    try:
        with pytest.raises(
            TypeError, match="returned \\(1,\\) for tensor 'w', expected shape \\(2, 2\\)"
        ):
            merge_state_dicts("broken_shape", {"w": torch.zeros(2, 2)}, [{"w": torch.ones(2, 2)}])
    finally:
        unregister_merge_method("broken_shape")


def test_every_engine_checks_results_the_same_way(tmp_path):
    """One set of result checks (MergeMethod.apply): dtype and NaN/Inf, in memory, streamed and
    in a direct call alike."""
    from mergelab.merge import MergeInputError
    from mergelab.merge.checkpoint import merge_checkpoints
    from mergelab.tiny import tiny_llama

    @merge_method("broken_dtype", per_model=())
    def broken_dtype(base, experts, *, ctx):
        return experts[0].double()

    @merge_method("broken_nan", per_model=(), needs_base=False)
    def broken_nan(base, experts, *, ctx):
        return experts[0] * float("nan")

    sd = {"w": torch.ones(2, 2)}
    model = tiny_llama(16, hidden_size=8, num_layers=1, num_heads=2, pad_token_id=None)
    model.save_pretrained(tmp_path / "m")
    try:
        with pytest.raises(
            TypeError, match="returned torch.float64 for tensor 'w', expected torch.float32"
        ):
            merge_state_dicts("broken_dtype", sd, [sd])
        with pytest.raises(MergeInputError, match="'broken_nan' produced NaN or Inf in tensor 'w'"):
            merge_state_dicts("broken_nan", sd, [sd])
        with pytest.raises(MergeInputError, match="'broken_nan' produced NaN or Inf in tensor 'w'"):
            get_merge_method("broken_nan")(sd["w"], [sd["w"]], ctx=TensorContext(name="w"))
        with pytest.raises(MergeInputError, match="'broken_nan' produced NaN or Inf in tensor"):
            merge_checkpoints(
                "broken_nan", None, [tmp_path / "m"], output=tmp_path / "out", progress=False
            )
        assert not (tmp_path / "out").exists()
    finally:
        unregister_merge_method("broken_dtype")
        unregister_merge_method("broken_nan")


def test_prepare_hook_gets_fresh_passes_and_its_stats_reach_every_tensor():
    """The whole-model first pass: make_iter() is a new pass each call; stats land in ctx."""
    passes = []

    def prepare(params, make_iter):
        total = 0.0
        for _ in range(2):  # two passes, like global TIES
            seen = [name for name, _, _ in make_iter()]
            passes.append(seen)
        for _, base, experts in make_iter():
            total += float(sum((e - base).abs().sum() for e in experts))
        return {"total_abs_delta": total, "scale": params["scale"]}

    @merge_method("shrink_by_total", per_model=(), prepare=prepare)
    def shrink_by_total(base, experts, *, scale: float = 1.0, ctx):
        """Task arithmetic divided by the total |τ| of the whole model (a toy global statistic)."""
        assert ctx.stats["scale"] == scale
        return base + scale * task_vectors(base, experts).sum(0) / ctx.stats["total_abs_delta"]

    try:
        base = {"a": torch.zeros(2), "b": torch.zeros(3), "n": torch.tensor(1)}
        expert = {"a": torch.ones(2), "b": torch.ones(3), "n": torch.tensor(1)}
        out = merge_state_dicts("shrink_by_total", base, [expert], params={"scale": 2.0})
        assert passes == [["a", "b"], ["a", "b"]]  # floating tensors only, every pass complete
        torch.testing.assert_close(out["b"], torch.full((3,), 2.0 / 5.0))
    finally:
        unregister_merge_method("shrink_by_total")


def test_calling_a_method_directly_on_one_tensor():
    """``method(base, experts, **params)``: the convenient form, also for global-scope TIES."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 10, generator=g)
    experts = [base + torch.randn(10, 10, generator=g) for _ in range(2)]
    ties = get_merge_method("ties")
    global_scope = ties(base, experts, density=0.3)  # this tensor is the whole "model"
    per_tensor = ties(base, experts, density=0.3, trim_scope="tensor")
    torch.testing.assert_close(global_scope, per_tensor, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs whole-model thresholds"):
        ties.fn(base, experts, weight=[1.0, 1.0], density=[0.3, 0.3], ctx=TensorContext())


def test_merge_input_error_is_a_value_error():
    assert issubclass(MergeInputError, ValueError)
