"""PNG plots for people: per-shape speedup with its confidence interval."""

from __future__ import annotations

from pathlib import Path


def speedup_bars(shapes: list[dict]) -> list[tuple[str, float, float, float, float]]:
    """Per shape: (name, bar start, bar end, CI low, CI high). Bars start at the 1x baseline
    and end at the speedup estimate; the error bar spans the CI."""
    return [(s["name"], 1.0, s["ratio"]["estimate"], s["ratio"]["ci_low"], s["ratio"]["ci_high"]) for s in shapes]


def speedup_plot(accepted: list[tuple[str, list[dict]]], path: Path, title: str) -> Path:
    """One panel per accepted submission (labelled with its task): each shape's speedup
    (baseline/candidate) as a bar from the 1x baseline, its CI as the error bar. The axis is
    logarithmic and centred on 1x, so a 2x win and a 2x loss are bars of equal length."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(
        len(accepted), 1, figsize=(8, 2.4 + 0.35 * max(len(s) for _, s in accepted) * len(accepted)), squeeze=False
    )
    for ax, (label, shapes) in zip(axes[:, 0], accepted):
        bars = speedup_bars(shapes)
        names = [b[0] for b in bars]
        est = [b[2] for b in bars]
        colors = ["#4c72b0" if e >= 1.0 else "#c44e52" for e in est]
        ax.barh(
            names,
            [end - start for _, start, end, _, _ in bars],
            left=[start for _, start, _, _, _ in bars],
            color=colors,
        )
        ax.errorbar(
            est,
            names,
            xerr=[[e - lo for _, _, e, lo, _ in bars], [hi - e for _, _, e, _, hi in bars]],
            fmt="none",
            ecolor="black",
            capsize=3,
        )
        ax.set_xscale("log")
        extremes = [b[3] for b in bars] + [b[4] for b in bars]
        reach = max(abs(math.log(x)) for x in extremes if x > 0) if any(x > 0 for x in extremes) else 0.0
        reach = max(reach * 1.15, math.log(1.1))
        ax.set_xlim(math.exp(-reach), math.exp(reach))
        times = FuncFormatter(lambda x, _: f"{x:g}x")
        ax.xaxis.set_major_formatter(times)
        ax.xaxis.set_minor_formatter(times)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("speedup (baseline / candidate), 1x = baseline; bars: CI")
        ax.set_title(label, fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Title": title, "Description": "; ".join(label for label, _ in accepted)})
    plt.close(fig)
    return path


def roofline_plot(accepted: list[tuple[str, list[dict]]], path: Path) -> Path | None:
    """Fraction of the physical floor (bytes/peak bandwidth or FLOPs/peak rate) reached per shape,
    baseline vs accepted candidate. None when no shape has a known floor."""
    rows = [(f"accepted #{k + 1}", s) for k, (_, shapes) in enumerate(accepted) for s in shapes if s.get("floor_s")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{s['name']} ({label})" if len(accepted) > 1 else s["name"] for label, s in rows]
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
