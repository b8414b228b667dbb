"""Interpolations between models: spherical (slerp, nuslerp, multislerp, the Karcher mean)
and Model Stock's, plain torch functions on tensors (part of the specification, as
:mod:`mergelab.merge.methods.steps`)."""

from __future__ import annotations

import math

import torch

# --- interpolation -------------------------------------------------------------------------------


def slerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    *,
    dot_threshold: float = 0.9995,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Spherical interpolation from ``v0`` (t = 0) to ``v1`` (t = 1), treating each as one vector.

    The angle is that of the normalised tensors; the result is
    sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1 on the raw tensors, and (1−t)·v0 + t·v1 when
    |cos θ| > ``dot_threshold`` (nearly colinear or antipodal). Norms ≤ ``eps`` count as 1.
    Same semantics as mergekit's ``slerp``.
    """
    norm0 = torch.linalg.vector_norm(v0)
    norm1 = torch.linalg.vector_norm(v1)
    norm0 = torch.where(norm0 > eps, norm0, 1)
    norm1 = torch.where(norm1 > eps, norm1, 1)
    dot = float(((v0 / norm0) * (v1 / norm1)).sum().clamp(-1, 1))
    if abs(dot) > dot_threshold:
        return (1 - t) * v0 + t * v1
    theta = math.acos(dot)
    sin_theta = math.sin(theta)
    return (math.sin((1 - t) * theta) / sin_theta) * v0 + (math.sin(t * theta) / sin_theta) * v1


def model_stock(
    base: torch.Tensor, experts: list[torch.Tensor], *, filter_wise: bool = False
) -> torch.Tensor:
    """Model Stock (Jang et al. 2024): θ_b + t (mean_i θ_i − θ_b), t = N c / (1 + (N − 1) c).

    c is the mean pairwise cosine between the experts' task vectors, computed over the whole
    tensor, or per vector along the last axis when ``filter_wise`` (1-D tensors then count as one
    row). Where 1 + (N − 1) c vanishes (|·| < 1e-6) t = 0, i.e. the base is kept. Same semantics
    as mergekit's ``model_stock``.
    """
    if len(experts) < 2:
        raise ValueError("model_stock needs at least two experts besides the base")
    shape = base.shape
    if filter_wise:
        view = (1, -1) if base.dim() == 1 else tuple(shape)
    else:
        view = (-1,)
    base_v = base.reshape(view)
    experts_v = [e.reshape(view) for e in experts]
    offsets = [e - base_v for e in experts_v]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
            cosines.append(((a * b).sum(-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cosines).mean(0).unsqueeze(-1)
    n = len(experts)
    denominator = 1 + (n - 1) * cos_theta
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, 0.0, n * cos_theta / torch.where(singular, 1.0, denominator))
    average = sum(experts_v) / n
    return (t * average + (1 - t) * base_v).reshape(shape)


def nuslerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    *,
    row_wise: bool = False,
    flatten: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Spherical interpolation of many vectors at once, from ``v0`` (t = 0) to ``v1`` (t = 1).

    The vectors are the whole tensor (``flatten``), or else its rows (slices along the last axis)
    or, with ``row_wise``, its slices along axis 0 (mergekit's names). For each pair the angle θ is
    that of the normalised vectors (norms clamped to ≥ 1e-7) and the result is
    (sin((1−t)θ) v0 + sin(tθ) v1) / sin θ, or (1−t) v0 + t v1 where 1 − cos²θ ≤ ``eps``² (colinear).
    Same semantics as mergekit's ``nuslerp``. Returns a tensor of ``v0``'s shape.
    """
    shape = v0.shape
    if flatten:
        a, b = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        a, b = v0.transpose(0, -1), v1.transpose(0, -1)
    else:
        a, b = v0, v1

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-7)

    cos_theta = (unit(a) * unit(b)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos_theta.square()) <= eps**2
    theta = torch.acos(torch.where(colinear, 0, cos_theta))
    spherical = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)
    result = torch.where(colinear, (1 - t) * a + t * b, spherical)
    if row_wise and not flatten:
        result = result.transpose(0, -1)
    return result.reshape(shape)


def multislerp(
    tensors: list[torch.Tensor],
    weights: list[float],
    *,
    normalize_weights: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Barycentric interpolation of several tensors on the hypersphere (mergekit's ``multislerp``).

    Each tensor x_i (shape ``S``) is one vector. With weights w_i (divided by Σ w_i when
    ``normalize_weights``): the unit vectors u_i = x_i / (‖x_i‖ + eps) are averaged,
    m = Σ w_i u_i / ‖Σ w_i u_i‖; their tangent components at m, v_i = u_i − (u_i · m) m, are
    averaged, v = Σ w_i v_i; one exponential-map step gives m cos‖v‖ + v sin‖v‖ / ‖v‖ (‖v‖ + eps
    in place of ‖v‖), scaled to the weighted mean norm Σ w_i ‖x_i‖. Where Σ w_i u_i ≈ 0 (norm < eps)
    two tensors fall back to w_0 x_0 + w_1 x_1 and more are refused (no direction to average).
    """
    stack = torch.stack(tensors)
    flat = stack.view(len(tensors), -1)
    w = torch.tensor(weights, dtype=stack.dtype, device=stack.device)
    if normalize_weights:
        w = w / w.sum()
    column = w.view(-1, 1)
    norms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * column).sum(0)
    mean_norm = torch.linalg.vector_norm(mean)
    if mean_norm < eps:
        if len(tensors) == 2:
            return (stack[0] * w[0] + stack[1] * w[1]).view(stack.shape[1:])
        raise ValueError(
            "multislerp: the weighted mean direction of the models is zero (e.g. opposite "
            "tensors a, -a with equal weights); change the weights"
        )
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    step = (tangents * column).sum(0)
    step_norm = torch.linalg.vector_norm(step) + eps
    result = mean * torch.cos(step_norm) + step * (torch.sin(step_norm) / step_norm)
    return (result * (norms.squeeze(-1) * w).sum()).view(stack.shape[1:])


def karcher_mean(
    tensors: list[torch.Tensor],
    weights: list[float],
    *,
    max_iter: int = 10,
    tol: float = 1e-5,
) -> torch.Tensor:
    """Weighted Karcher (Fréchet) mean on the unit sphere, rescaled by the weighted mean norm.

    Each tensor x_i is one vector; α_i = w_i / Σ w_i. The directions u_i = x_i / ‖x_i‖ of the
    tensors with ‖x_i‖ > ``tol`` are averaged on the sphere by Riemannian gradient steps from their
    normalised (Euclidean) weighted mean: the tangent Σ α_i θ_i/sin θ_i (u_i − cos θ_i m) (α
    renormalised over those tensors; terms with θ_i < ``tol`` skipped) is followed along the great
    circle, at most ``max_iter`` times, stopping once its norm is < ``tol``. The result is
    (Σ_i α_i ‖x_i‖) · m over all tensors. Same algorithm as mergekit's ``karcher`` (which uses
    α_i = 1/n). All-zero inputs give zeros; one tensor gives itself. Norms and angles in float32
    (float64 for float64 input).
    """
    if len(tensors) == 1:
        return tensors[0].clone()
    total = sum(weights)
    alphas = [w / total for w in weights]
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = [torch.linalg.vector_norm(x.to(dtype)) for x in tensors]
    valid = [i for i, norm in enumerate(norms) if norm.item() > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    units = [(tensors[i] / norms[i]).to(tensors[i].dtype) for i in valid]
    valid_total = sum(alphas[i] for i in valid)
    valid_alphas = [alphas[i] / valid_total for i in valid]
    mean = torch.zeros_like(units[0])
    for alpha, u in zip(valid_alphas, units):
        mean += alpha * u
    mean_norm = torch.linalg.vector_norm(mean.to(dtype))
    # Directions that cancel out: start from the first one instead.
    mean = units[0].clone() if mean_norm.item() < tol else (mean / mean_norm).to(mean.dtype)
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for alpha, u in zip(valid_alphas, units):
            cos_theta = torch.dot(mean.flatten(), u.flatten()).clamp(-1.0, 1.0)
            theta = torch.arccos(cos_theta)
            if theta.item() < tol:
                continue
            tangent += alpha * (theta / torch.sin(theta)) * (u - cos_theta * mean)
        tangent_norm = torch.linalg.vector_norm(tangent.to(dtype))
        if tangent_norm.item() < tol:
            break
        mean = (
            torch.cos(tangent_norm) * mean + torch.sin(tangent_norm) * (tangent / tangent_norm)
        ).to(mean.dtype)
        mean_norm = torch.linalg.vector_norm(mean.to(dtype))
        if mean_norm.item() > tol:  # back onto the sphere against round-off
            mean = (mean / mean_norm).to(mean.dtype)
    return sum(alpha * norm for alpha, norm in zip(alphas, norms)) * mean
