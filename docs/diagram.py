"""The README's diagram (docs/diagram.png): the daemon, its workers, the two pools, and a resize
and a loan as the operation sequences the daemon sends.

    python docs/diagram.py docs/diagram.png      # what `make figures` runs (matplotlib: the plot extra)
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

TRAIN, ROLL, DAEMON, GREY = "#4c72b0", "#dd8452", "#55a868", "#8c8c8c"


def box(ax, x, y, w, h, text, color, *, size=9, fill=0.15, weight="normal", align="center"):  # type: ignore[no-untyped-def]
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=matplotlib.colors.to_rgba(color, fill), ec=color, lw=1.4))
    tx = x + w / 2 if align == "center" else x + 0.12
    ax.text(tx, y + h / 2, text, ha=align, va="center", fontsize=size, weight=weight, linespacing=1.35)


def arrow(ax, a, b, text="", color=GREY, *, style="-|>", offset=(0.0, 0.0), size=8):  # type: ignore[no-untyped-def]
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=12, color=color, lw=1.3))
    if text:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], text, fontsize=size,
                ha="center", va="center", color="#333333")


def sequence(ax, x, y, title, ops, color):  # type: ignore[no-untyped-def]
    ax.text(x, y + 0.42, title, fontsize=9, weight="bold")
    for i, (op, who) in enumerate(ops):
        box(ax, x + i * 1.62, y - 0.32, 1.42, 0.56, f"{op}\n{who}", color, size=7.5, fill=0.1)
        if i:
            arrow(ax, (x + i * 1.62 - 0.2, y - 0.04), (x + i * 1.62, y - 0.04))


def draw(path: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 7.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 7.2)
    ax.axis("off")

    box(ax, 2.9, 5.35, 6.2, 1.6, "\ncore: step(state, event) -> (state, facts, ops)\npolicy + hysteresis guards decide\n"
        "event log (SQLite): facts are written before the ops they imply leave", DAEMON, size=8.5)
    ax.text(6.0, 6.7, "dynaresized: one daemon on the head node", ha="center", fontsize=9.5, weight="bold")
    box(ax, 0.1, 5.75, 2.2, 0.8, "operator\ndynaresized resize 4:4", GREY, size=8)
    arrow(ax, (2.3, 6.15), (2.9, 6.15), "control", style="<|-|>", offset=(0, 0.2))
    box(ax, 9.7, 5.75, 2.2, 0.8, "your RL loop\nreports step timings", GREY, size=8)
    arrow(ax, (9.7, 6.15), (9.1, 6.15), "steps", offset=(0, 0.2))

    # the pools: one engine worker and one trainer worker on every device
    box(ax, 0.3, 2.45, 6.9, 1.95, "", TRAIN, fill=0.06)
    ax.text(0.45, 4.15, "training pool: trainer ranks train (their engines released)", fontsize=8.5, color=TRAIN,
            weight="bold")
    box(ax, 7.5, 2.45, 4.2, 1.95, "", ROLL, fill=0.06)
    ax.text(7.65, 4.15, "rollout pool: engines generate", fontsize=8.5, color=ROLL, weight="bold")
    for i in range(6):
        box(ax, 0.5 + i * 1.1, 2.7, 0.95, 1.15, f"gpu{i}\ntrainer *\nengine", TRAIN, size=7.5, fill=0.25)
    for i in range(2):
        box(ax, 7.75 + i * 1.1, 2.7, 0.95, 1.15, f"gpu{6 + i}\nengine *\ntrainer", ROLL, size=7.5, fill=0.25)
    ax.text(10.05, 3.25, "* the worker\nthat serves", fontsize=7.5, color="#333333")
    arrow(ax, (5.0, 5.35), (3.8, 4.4), "ops (ZeroMQ)", style="-|>", offset=(-0.55, 0.05))
    arrow(ax, (4.6, 4.4), (5.6, 5.35), "heartbeats,\nop results", offset=(0.75, -0.05))
    arrow(ax, (7.0, 5.35), (9.0, 4.4), "ops", offset=(0.35, 0.1))

    sequence(ax, 0.3, 1.55, "a resize (6:2 -> 4:4): gpu4, gpu5 move for good, one op at a time, at safe points",
             [("drain", "trainers 4, 5"), ("release", "trainers 4, 5"), ("join", "engines 4, 5"),
              ("restore", "engines 4, 5"), ("commit", "every worker")], TRAIN)
    sequence(ax, 0.3, 0.35, "a loan (inside one step): an idle engine joins the training step in progress",
             [("drain", "engine 7"), ("release", "engine 7"), ("join", "trainer 7")], ROLL)
    ax.text(5.3, 0.03, "... and goes home at the step boundary (the same ops the other way)", fontsize=8,
            color="#333333")
    ax.text(8.55, 1.25, "undo ops (resume, reclaim, evict) roll\nback a failed sequence; a restarted\n"
            "daemon replays its log and converges\nwhat each worker holds with it", fontsize=8, color="#333333")
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "docs/diagram.png")
