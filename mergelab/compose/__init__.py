"""Logit (probability-space) composition of a base and experts that share a vocabulary."""

from .formula import compose_logprobs

__all__ = ["compose_logprobs"]
