"""One look for every figure mergelab and its studies draw.

A reader compares figures side by side, so a family of candidates has one colour everywhere
(``FAMILY_COLORS``, the Okabe–Ito palette, safe for colour-blind readers), floors are dashed black
lines, and text stays legible at the size the documentation shows it. Use::

    from mergelab import figure_style

    with figure_style.style():
        fig, ax = plt.subplots()
        ax.bar(..., color=figure_style.family_color("composition"))
        figure_style.label_points(ax, xs, ys, names, colors)  # labels that never overlap

``label_points`` writes point labels in a column beside the axes, each joined to its point by a
thin line, spread so that no two overlap — for scatter plots where several candidates share a
score or a cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
FAMILY_COLORS = {
    "base": "#7f7f7f",
    "expert": "#0072B2",
    "composition": "#D55E00",
    "merge": "#009E73",
    "lora_composition": "#E69F00",
    "lora_merge": "#56B4E9",
}
OTHER_COLOR = "#CC79A7"
FLOOR_COLOR = "#000000"

RC: dict[str, Any] = {
    "figure.dpi": 120,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
}
LABEL_SIZE = 8  # points: the labels label_points writes


def family_color(family: str) -> str:
    """The colour of a candidate family (``compare``'s family names; ``"merge (ties)"`` counts as
    ``merge``); one colour for anything else."""
    return FAMILY_COLORS.get(family.split(" (")[0], OTHER_COLOR)


@contextlib.contextmanager
def style() -> Iterator[None]:
    """matplotlib's settings for one figure (or several), restored afterwards."""
    import matplotlib.pyplot as plt

    with plt.rc_context(RC):
        yield


def spread(
    positions: Sequence[float],
    gap: float,
    low: float = 0.0,
    high: float = 1.0,
    tie_order: Sequence[float] | None = None,
) -> list:
    """Positions (in any order) moved apart to be at least ``gap`` apart and inside
    [``low``, ``high``], each as close to where it was as that allows, their order kept (equal
    positions ordered by ``tie_order``, ascending); returned in input order. When they cannot
    fit, they are spaced evenly over the interval."""
    ties = tie_order if tie_order is not None else [0.0] * len(positions)
    order = sorted(range(len(positions)), key=lambda i: (positions[i], ties[i]))
    n = len(order)
    if n == 0:
        return []
    if gap * (n - 1) > high - low:
        gap = (high - low) / max(n - 1, 1)
    placed = [min(max(positions[i], low), high) for i in order]
    for k in range(1, n):  # push up past the one below
        placed[k] = max(placed[k], placed[k - 1] + gap)
    placed[-1] = min(placed[-1], high)
    for k in range(n - 2, -1, -1):  # then down below the one above, within the interval
        placed[k] = min(placed[k], placed[k + 1] - gap)
    shift = low - placed[0]
    if shift > 0:
        placed = [p + shift for p in placed]
    out = [0.0] * n
    for k, i in enumerate(order):
        out[i] = placed[k]
    return out


def label_points(ax, xs, ys, labels, colors, *, side: str = "right") -> None:
    """Label points of ``ax`` in a column beside it (``side``), joined by thin lines, so that
    labels never overlap whatever the points do. Call after the axes' limits are final."""
    fig = ax.figure
    height_in = ax.get_position().height * fig.get_figheight()
    gap = 1.3 * LABEL_SIZE / 72 / height_in  # one line of text, in axes fractions
    to_axes = ax.transAxes.inverted()
    frac = [to_axes.transform(ax.transData.transform((x, y)))[1] for x, y in zip(xs, ys)]
    frac = [round(f, 6) for f in frac]
    where = spread(frac, gap)
    # Points at one height: the leader lines must not cross, so the leftmost point takes the
    # label farthest from that height (the top one when the labels were pushed up, the bottom
    # one when they were pushed down) and the rightmost the nearest.
    across = [to_axes.transform(ax.transData.transform((x, y)))[0] for x, y in zip(xs, ys)]
    for height in set(frac):
        group = [i for i, f in enumerate(frac) if f == height]
        slots = sorted(where[i] for i in group)
        pushed_up = sum(slots) / len(slots) >= height
        by_x = sorted(group, key=lambda i: across[i])
        for i, slot in zip(by_x, slots[::-1] if pushed_up else slots):
            where[i] = slot
    x_text = 1.03 if side == "right" else -0.03
    for x, y, text, color, yf in zip(xs, ys, labels, colors, where):
        ax.annotate(
            text,
            xy=(x, y),
            xycoords="data",
            xytext=(x_text, yf),
            textcoords="axes fraction",
            fontsize=LABEL_SIZE,
            color=color,
            va="center",
            ha="left" if side == "right" else "right",
            arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6, "alpha": 0.5},
            annotation_clip=False,
        )


def family_legend(ax, families: Sequence[str], **kwargs) -> None:
    """A legend with one coloured square per family, in the order given."""
    from matplotlib.patches import Patch

    handles = [Patch(color=family_color(f), label=f) for f in dict.fromkeys(families)]
    ax.legend(handles=handles, **kwargs)


MAX_COLUMNS = 3  # panels per row: more and the text is too small at page width


def panels(n: int, width: float, height: float, **kwargs):
    """A figure of ``n`` panels, at most :data:`MAX_COLUMNS` per row, each ``width`` × ``height``
    inches; returns the figure and the ``n`` axes in reading order (spare grid cells removed).
    ``kwargs`` go to ``plt.subplots`` (``sharey=True`` and the like)."""
    import matplotlib.pyplot as plt

    cols = max(1, min(n, MAX_COLUMNS))
    rows = max(1, -(-n // cols))
    fig, grid = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, **kwargs
    )
    axes = list(grid.flat)
    for ax in axes[n:]:
        fig.delaxes(ax)
    return fig, axes[:n]


def candidate_family(name: str) -> str:
    """The family of a study candidate from its name (the studies name candidates
    ``base``, ``math_expert``, ``code_lora``, ``composition_weighted``, ``lora_composition``,
    ``lora_merge_ties``, ``ties``…): the key :func:`family_color` reads."""
    n = name.lower()
    if n.startswith("lora_compos"):
        return "lora_composition"
    if n.startswith("lora_merge"):
        return "lora_merge"
    if "compos" in n or "product" in n:
        return "composition"
    if n.startswith("base"):
        return "base"
    if "expert" in n or n.endswith("_lora"):
        return "expert"
    return "merge"


def family_shades(family: str, n: int) -> list[str]:
    """``n`` shades of a family's colour, darkest first, for several rows of one family in one
    panel (tell them apart by line style and marker too: shades alone are hard to read)."""
    from matplotlib.colors import to_hex, to_rgb

    base = to_rgb(family_color(family))
    if n == 1:
        return [to_hex(base)]
    out = []
    for k in range(n):
        t = -0.45 + 0.9 * k / (n - 1)  # -0.45 (towards black) … +0.45 (towards white)
        target = 0.0 if t < 0 else 1.0
        out.append(to_hex(tuple(c + abs(t) * (target - c) for c in base)))
    return out
