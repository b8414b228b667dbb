"""Helpers shared by the tests that pin merge methods to mergekit 0.1.5 (and PEFT).

Import after ``pytest.importorskip("mergekit...")``: this module imports mergekit itself.
"""

import copy

import torch
from mergekit.merge_methods import registry as mk_registry
from mergekit.merge_methods.base import TensorGroup

from mergelab.merge import TensorContext, get_merge_method
from mergelab.tiny import tiny_llama

WEIGHTS = [1.0, 0.5, 0.8]


def mergekit(method, base, experts, name="w", dtype=torch.float32, **parameters):
    """Run a mergekit method (a name or a method object) on one tensor through its public
    per-group API."""
    if isinstance(method, str):
        method = mk_registry.get(method)
    tensors = ([base] if base is not None else []) + list(experts)
    group = TensorGroup.from_tensors(tensors, base_index=0 if base is not None else None, name=name)
    (out,) = method([group], parameters=parameters, dtype=dtype)
    return out


def run(method, base, experts, name="w", seed=0, **params):
    """Our method on one tensor, with the per-tensor generator of (seed, name)."""
    return get_merge_method(method)(
        base, experts, ctx=TensorContext(name=name, seed=seed), **params
    )


def tiny_llama_family():
    """A 2-layer Llama base (vocab 96, hidden 32, GQA 4/2 heads, untied) and three experts =
    base + dense perturbations of scale 0.02, 0.01, 0.03 (seeded)."""
    base = tiny_llama(
        96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_key_value_heads=2,
        seed=0,
        pad_token_id=None,
    )
    experts = []
    for scale in (0.02, 0.01, 0.03):
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(scale * torch.randn_like(p))
        experts.append(expert)
    return base, experts
