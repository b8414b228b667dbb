"""The linear testbed: when task arithmetic is logit composition (``run.py``: the recipe; ``figures.py``: the figures, from the results files only)."""
