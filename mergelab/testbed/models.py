"""Next-token models over a fixed context feature map: log-linear, MLP, and linearised.

All take contexts ``[N, context_length]`` (token ids) and return logits ``[N, V]``.

* :class:`LogLinearModel` — z = Φ(x)·θ: logits are *linear in the parameters*, so task arithmetic
  on θ is exactly logit composition (docs/composition.md §3).
* :class:`MLPModel` — Φ(x) → depth × (Linear, σ_α) → Linear. σ_α(u) = (1 − α)·u + α·act(u)
  interpolates from the identity (α = 0) to GELU or ReLU (α = 1). Even at α = 0 the logits are
  *not* linear in the parameters for depth ≥ 1 (products of weight matrices).
* :class:`LinearizedModel` — f(θ_b) + J(θ_b)(θ − θ_b), the first-order Taylor model of any network
  around its base parameters (tangent-space fine-tuning, Ortiz-Jiménez et al. 2023).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, jvp


class ContextFeatures(nn.Module):
    """The fixed feature map Φ: one-hot of each context position, concatenated.

    ``[N, context_length]`` long → ``[N, context_length * V]`` (no parameters).
    """

    def __init__(self, vocab_size: int, context_length: int = 2, dtype=torch.float64):
        super().__init__()
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.dtype = dtype

    @property
    def dim(self) -> int:
        return self.vocab_size * self.context_length

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        if contexts.dim() != 2 or contexts.shape[1] != self.context_length:
            raise ValueError(
                f"contexts must be [N, {self.context_length}] token ids, got {tuple(contexts.shape)}"
            )
        one_hot = nn.functional.one_hot(contexts, self.vocab_size).to(self.dtype)
        return one_hot.reshape(contexts.shape[0], -1)


class LogLinearModel(nn.Module):
    """z = Φ(x)·θ with θ = (weight ``[V, D]``, bias ``[V]``): log-linear in the parameters."""

    def __init__(self, vocab_size: int, context_length: int = 2, dtype=torch.float64):
        super().__init__()
        self.features = ContextFeatures(vocab_size, context_length, dtype)
        self.readout = nn.Linear(self.features.dim, vocab_size, dtype=dtype)

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        return self.readout(self.features(contexts))


class BlendedActivation(nn.Module):
    """σ_α(u) = (1 − α)·u + α·act(u): α = 0 is the identity, α = 1 is GELU (or ReLU)."""

    def __init__(self, alpha: float, kind: str = "gelu"):
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"non-linearity alpha must be in [0, 1], got {alpha}")
        acts = {"gelu": nn.functional.gelu, "relu": nn.functional.relu}
        if kind not in acts:
            raise ValueError(f"activation must be one of {sorted(acts)}, got {kind!r}")
        self.alpha, self.kind, self.act = float(alpha), kind, acts[kind]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return (1.0 - self.alpha) * u + self.alpha * self.act(u)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, kind={self.kind}"


class MLPModel(nn.Module):
    """Φ(x) → ``depth`` hidden layers of width ``hidden`` with σ_α → readout to ``V`` logits."""

    def __init__(
        self,
        vocab_size: int,
        *,
        depth: int = 2,
        hidden: int = 64,
        alpha: float = 1.0,
        activation: str = "gelu",
        context_length: int = 2,
        dtype=torch.float64,
    ):
        super().__init__()
        if depth < 1:
            raise ValueError(
                f"MLP depth must be >= 1 (use LogLinearModel for depth 0), got {depth}"
            )
        self.features = ContextFeatures(vocab_size, context_length, dtype)
        layers: list[nn.Module] = []
        width = self.features.dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden, dtype=dtype), BlendedActivation(alpha, activation)]
            width = hidden
        self.hidden = nn.Sequential(*layers)
        self.readout = nn.Linear(width, vocab_size, dtype=dtype)

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        return self.readout(self.hidden(self.features(contexts)))


class LinearizedModel(nn.Module):
    """f_lin(x; θ) = f(x; θ_b) + J_θ f(x; θ_b)·(θ − θ_b), computed with one ``torch.func.jvp``.

    ``self.network`` holds θ (trainable; starts at θ_b); θ_b is a frozen copy kept outside the
    state dict, so the state dict has the same keys for every linearisation of one base and weight
    merges apply to θ directly. Logits are exactly linear in θ: task arithmetic of tangent-space
    experts is logit composition.
    """

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = copy.deepcopy(network)
        # A plain dict, not buffers: θ_b must not appear in (or be merged through) the state dict.
        self.base_params = {k: v.detach().clone() for k, v in self.network.named_parameters()}

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        params = dict(self.network.named_parameters())
        delta = {k: params[k] - self.base_params[k] for k in params}

        def f(p):
            return functional_call(self.network, p, (contexts,))

        base_logits, directional = jvp(f, (self.base_params,), (delta,))
        return base_logits + directional


def build_model(
    kind: str,
    vocab_size: int,
    *,
    depth: int = 2,
    hidden: int = 64,
    alpha: float = 1.0,
    activation: str = "gelu",
    seed: int = 0,
) -> nn.Module:
    """``kind`` = "loglinear" or "mlp"; parameters are initialised from ``seed`` (float64)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "loglinear":
            return LogLinearModel(vocab_size)
        if kind == "mlp":
            return MLPModel(
                vocab_size, depth=depth, hidden=hidden, alpha=alpha, activation=activation
            )
    raise ValueError(f"model kind must be 'loglinear' or 'mlp', got {kind!r}")
