"""Artifacts: full tables as CSV and JSON, and a PNG of the time breakdown."""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from loom_mcp.traces.analysis import FullAnalysis
from loom_mcp.traces.diff import FullDiff
from loom_mcp.traces.models import DiffRow
from loom_mcp.traces.secrets import scrub_any, scrub_text

PNG = "breakdown.png"


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    # Every artifact is written through here or `_write_json`: both scrub what they write.
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows([scrub_text(x) if isinstance(x, str) else x for x in row] for row in rows)


def _write_json(path: Path, doc: Any) -> None:
    path.write_bytes(orjson.dumps(scrub_any(doc), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _ops_rows(fa: FullAnalysis) -> list[list[Any]]:
    rows = []
    for g in fa.groups:
        r, w = g.roof, g.work
        rows.append(
            [
                g.full_name,
                g.shapes,
                g.via,
                g.category,
                g.calls,
                g.kernels,
                round(g.time_us, 3),
                w.flops if w else None,
                w.bytes if w else None,
                r.tflops,
                r.tbps,
                r.pct,
                r.bound,
                r.floor_us,
                r.note,
            ]
        )
    return rows


_OPS_HEADER = [
    "name",
    "shapes",
    "via",
    "category",
    "calls",
    "kernels",
    "time_us",
    "flops_per_call",
    "bytes_per_call",
    "tflops",
    "tbps",
    "roofline_pct",
    "bound",
    "roofline_floor_us",
    "note",
]


def _diff_rows(rows: list[DiffRow]) -> list[list[Any]]:
    return [[r.name, r.base_us, r.new_us, r.delta_us, r.delta_pct] for r in rows]


def full_json(fa: FullAnalysis, d: FullDiff | None) -> dict[str, Any]:
    return {
        "trace": fa.trace,
        "source_format": fa.source_format,
        "device": fa.device_name,
        "devices": {str(k): v for k, v in fa.devices.items()},
        "peak": fa.peak.model_dump() if fa.peak is not None and hasattr(fa.peak, "model_dump") else None,
        "timelines": [asdict(t) for t in fa.timelines],
        "linking": asdict(fa.links),
        "categories": [asdict(c) for c in fa.categories],
        "ops": [dict(zip(_OPS_HEADER, row, strict=True)) for row in _ops_rows(fa)],
        "kernels": [asdict(k) for k in fa.kernels],
        "findings": [f.model_dump() for f in fa.findings],
        "metadata_blocks": {
            k: {"keys": v[0], "secret_like_keys": v[1], "secret_like_values": v[2]}
            for k, v in fa.metadata_blocks.items()
        },
        "notes": fa.notes,
        "diff": None
        if d is None
        else {
            "summary": d.summary.model_dump(),
            "totals": [r.model_dump() for r in d.totals],
            "categories": [r.model_dump() for r in d.categories],
            "ops": [r.model_dump() for r in d.ops],
            "kernels": [r.model_dump() for r in d.kernels],
        },
    }


def plot(fa: FullAnalysis, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.3]})
    t = fa.primary
    if t is not None:
        parts = [
            ("computation", t.computation_us, "#4C72B0"),
            ("exposed comm", t.exposed_comm_us, "#DD8452"),
            ("exposed memcpy", t.exposed_memcpy_us, "#55A868"),
            (f"idle < {t.short_gap_threshold_us:.0f} µs", t.idle_short_us, "#C7C7C7"),
            ("idle (long gaps)", t.idle_long_us, "#8C8C8C"),
        ]
        left = 0.0
        for label, v, color in parts:
            ax1.barh([0], [v / 1000], left=left / 1000, color=color, label=f"{label}: {v / 1000:.2f} ms")
            left += v
        ax1.set_yticks([])
        ax1.set_xlabel("ms")
        ax1.set_title(
            f"Timeline ({scrub_text(fa.device_name or 'device')}), total {t.total_us / 1000:.2f} ms", fontsize=9
        )
        ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
        cat_rows = [(c.category, c.time_us) for c in fa.categories[:10]]
        ax2.set_xlabel("summed kernel time (ms)")
    else:
        # No GPU activity (a CPU run): the host ops and their categories, by top-level host time.
        top = fa.groups[:8]
        ax1.barh(
            [scrub_text(f"{g.name} {g.shapes}".strip())[:40] for g in top][::-1],
            [g.time_us / 1000 for g in top][::-1],
            color="#4C72B0",
        )
        ax1.set_xlabel("host time (ms)")
        ax1.set_title("Top host ops (no GPU activity in the trace)", fontsize=9)
        ax1.tick_params(labelsize=7)
        by_cat: dict[str, float] = {}
        for g in fa.groups:
            by_cat[g.category] = by_cat.get(g.category, 0.0) + g.time_us
        cat_rows = sorted(by_cat.items(), key=lambda kv: -kv[1])[:10]
        ax2.set_xlabel("host op time (ms)")
    ax2.barh([c for c, _ in cat_rows][::-1], [us / 1000 for _, us in cat_rows][::-1], color="#4C72B0")
    ax2.set_title("Categories", fontsize=9)
    ax2.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_artifacts(fa: FullAnalysis, d: FullDiff | None, out_dir: Path, png: bool = True) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []

    def put(name: str) -> Path:
        names.append(name)
        return out_dir / name

    _write_json(put("analysis.json"), full_json(fa, d))
    _write_csv(put("ops.csv"), _OPS_HEADER, _ops_rows(fa))
    _write_csv(
        put("kernels.csv"),
        ["name", "short", "category", "count", "time_us", "min_us", "max_us", "graph_replayed"],
        [[k.name, k.short, k.category, k.count, round(k.time_us, 3), k.min_us, k.max_us, k.graph] for k in fa.kernels],
    )
    total = fa.gpu_time_us or 1.0
    _write_csv(
        put("categories.csv"),
        ["category", "time_us", "pct", "count", "top_kernels"],
        [
            [
                c.category,
                round(c.time_us, 3),
                round(100 * c.time_us / total, 2),
                c.count,
                " | ".join(c.top),
            ]
            for c in fa.categories
        ],
    )
    if fa.timelines:
        fields = list(asdict(fa.timelines[0]))
        _write_csv(put("timeline.csv"), fields, [[getattr(t, f) for f in fields] for t in fa.timelines])
    if d is not None:
        hdr = ["name", "base_us", "new_us", "delta_us", "delta_pct"]
        _write_csv(put("diff_totals.csv"), hdr, _diff_rows(d.totals))
        _write_csv(put("diff_categories.csv"), hdr, _diff_rows(d.categories))
        _write_csv(put("diff_ops.csv"), hdr, _diff_rows(d.ops))
        _write_csv(put("diff_kernels.csv"), hdr, _diff_rows(d.kernels))
    if png:
        plot(fa, put(PNG))
    return names
