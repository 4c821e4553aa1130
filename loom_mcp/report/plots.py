"""PNG plots for people: per-shape speedup with its confidence interval."""

from __future__ import annotations

from pathlib import Path


def speedup_plot(accepted: list[tuple[str, list[dict]]], path: Path) -> Path:
    """One panel per accepted submission: each shape's speedup (baseline/candidate) with CI bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(accepted), 1, figsize=(8, 2.2 + 0.35 * max(len(s) for _, s in accepted)
                                                       * len(accepted)), squeeze=False)
    for ax, (label, shapes) in zip(axes[:, 0], accepted):
        names = [s["name"] for s in shapes]
        est = [s["ratio"]["estimate"] for s in shapes]
        low = [s["ratio"]["estimate"] - s["ratio"]["ci_low"] for s in shapes]
        high = [s["ratio"]["ci_high"] - s["ratio"]["estimate"] for s in shapes]
        ax.barh(names, est, xerr=[low, high], color="#4c72b0", ecolor="black", capsize=3)
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("speedup (baseline / candidate), 95% CI")
        ax.set_title(label, fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def roofline_plot(accepted: list[tuple[str, list[dict]]], path: Path) -> Path | None:
    """Fraction of the physical floor (bytes/peak bandwidth or FLOPs/peak rate) reached per shape,
    baseline vs accepted candidate. None when no shape has a known floor."""
    rows = [(label, s) for label, shapes in accepted for s in shapes if s.get("floor_s")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{s['name']} ({label[-8:]})" for label, s in rows]
    base = [s["floor_s"] / s["baseline"]["median"] for _, s in rows]
    cand = [s["floor_s"] / s["candidate"]["median"] for _, s in rows]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.45 * len(rows)))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], base, height=0.4, label="baseline", color="#dd8452")
    ax.barh([i + 0.2 for i in y], cand, height=0.4, label="accepted candidate", color="#4c72b0")
    ax.set_yticks(list(y), names)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("fraction of the roofline (physical floor / median time)")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
