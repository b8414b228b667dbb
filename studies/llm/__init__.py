"""The LLM study: logit composition vs weight merges of a math and a code expert.

``run.py`` is the recipe (read it first); ``figures.py`` draws every figure from the results
file alone. The other modules are the study's own parts: its configuration (``config``), the
synthetic benchmarks and models of each scale (``setting``), the main table as a
``mergelab.compare`` spec (``candidates``), and the analyses of termination (``termination``)
and factorisation (``diagnostics``).
"""
