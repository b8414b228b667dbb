"""mergelab.figure_style: labels spread apart never overlap and keep their order, families keep
one colour, and the compare figures draw a label for every point."""

from __future__ import annotations

import random

import pytest

from mergelab import figure_style as fs


@pytest.mark.parametrize("seed", range(20))
def test_spread_keeps_order_gap_and_bounds(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 15)
    positions = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(n)]
    gap = 0.05
    placed = fs.spread(positions, gap)
    order = sorted(range(n), key=lambda i: positions[i])
    ys = [placed[i] for i in order]
    assert all(0.0 - 1e-12 <= y <= 1.0 + 1e-12 for y in ys)
    assert all(b - a >= gap - 1e-12 for a, b in zip(ys, ys[1:]))


def test_spread_moves_nothing_that_already_fits():
    assert fs.spread([0.1, 0.5, 0.9], 0.05) == [0.1, 0.5, 0.9]


def test_spread_evenly_when_labels_cannot_fit():
    placed = sorted(fs.spread([0.5] * 11, 0.2))
    assert placed[0] == pytest.approx(0.0) and placed[-1] == pytest.approx(1.0)
    assert all(b - a == pytest.approx(0.1) for a, b in zip(placed, placed[1:]))


def test_equal_positions_are_ordered_by_the_tie_order():
    placed = fs.spread([0.5, 0.5, 0.5], 0.1, tie_order=[3.0, 1.0, 2.0])
    assert placed[1] < placed[2] < placed[0]


def test_family_colours_are_distinct_and_merge_variants_share_one():
    assert len(set(fs.FAMILY_COLORS.values())) == len(fs.FAMILY_COLORS)
    assert fs.family_color("merge (ties)") == fs.family_color("merge")
    assert fs.family_color("something else") == fs.OTHER_COLOR


def test_label_points_labels_every_point_without_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    with fs.style():
        fig, ax = plt.subplots(figsize=(5, 3))
        xs, ys = [1.0] * 6, [100.0] * 5 + [0.0]
        ax.scatter(xs, ys)
        ax.set_ylim(-5, 105)
        fs.label_points(ax, xs, ys, [f"row{i}" for i in range(6)], ["#000000"] * 6)
        fig.canvas.draw()
        boxes = [Text.get_window_extent(t) for t in ax.texts]  # the text, not its line
        plt.close(fig)
    assert len(boxes) == 6
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_panels_at_most_three_per_row(n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = fs.panels(n, 3.0, 2.0)
    assert len(axes) == n and len(fig.axes) == n
    lefts = sorted({round(ax.get_position().x0, 4) for ax in axes})
    assert len(lefts) == min(n, fs.MAX_COLUMNS)
    plt.close(fig)


def test_study_candidates_take_their_family_colour():
    families = {
        "base": "base",
        "math_expert": "expert",
        "code_lora": "expert",
        "composition": "composition",
        "composition_weighted": "composition",
        "lora_composition": "lora_composition",
        "lora_merge_task_arithmetic": "lora_merge",
        "ties": "merge",
        "dare_ties": "merge",
    }
    for name, family in families.items():
        assert fs.candidate_family(name) == family, name
    assert fs.family_color(fs.candidate_family("ties")) != fs.family_color("composition")


def test_family_shades_are_distinct_and_keep_the_family_hue():
    from matplotlib.colors import rgb_to_hsv, to_rgb

    shades = fs.family_shades("merge", 4)
    assert len(set(shades)) == 4
    hue = rgb_to_hsv(to_rgb(fs.family_color("merge")))[0]
    for s in shades:
        assert abs(rgb_to_hsv(to_rgb(s))[0] - hue) < 0.02
    assert fs.family_shades("merge", 1) == [fs.family_color("merge").lower()]
