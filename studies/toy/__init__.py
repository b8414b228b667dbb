"""The toy study: logit composition and weight merges on tiny GPT-2 models trained on CPU.

``run.py`` is the recipe (read it first); ``figures.py`` draws every figure from the results
files; ``authors_exact.py`` is the authors' notebook setting by setting; ``explanations.py``
tests the study's explanations of its surprises; ``many_experts.py`` composes three and four
experts. The task generators come from the library (:mod:`mergelab.toy`); the tiny models and
their training loop from :mod:`mergelab.tiny`.
"""
