"""Draw a run's series into PNG files: one overview and one file per quantity, segments shaded, checkpoints marked."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Figures made without pyplot (which picks a process-wide backend, a display's where there is one): each Figure
# draws on its own Agg canvas, so importing this module changes nothing for the user's own plots.
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from torchrelay.report.series import RunSeries
from torchrelay.util.durable import atomic_write_bytes

SEGMENT_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#9D755D", "#EECA3B"]
DPI = 110


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (as TensorBoard draws it); NaNs are carried, not smoothed over."""
    if weight is None:
        # Longer runs get a longer memory so the trend stays readable at any length.
        weight = min(0.95, max(0.5, 1.0 - 10.0 / max(len(values), 1)))
    out, avg, norm = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        avg = weight * avg + (1.0 - weight) * value
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm if norm else value)
    return out


def _x_range(series: RunSeries) -> tuple[float, float]:
    last = max(series.updates[-1], max(series.checkpoints, default=0))
    return series.updates[0] - 0.5, last + 0.5


def _decorate(ax: Axes, series: RunSeries, *, labels: bool) -> None:
    """Shade each segment, draw segment boundaries and checkpoint markers on one axis."""
    lo, hi = _x_range(series)
    for seg in series.segments:
        end = seg.last_update if seg.last_update is not None else series.updates[-1]
        if end < seg.first_update:
            continue  # a launch that stopped before its first update has no width to shade
        color = SEGMENT_COLORS[(seg.index - 1) % len(SEGMENT_COLORS)]
        ax.axvspan(seg.first_update - 0.5, end + 0.5, color=color, alpha=0.13, lw=0)
        ax.axvline(seg.first_update - 0.5, color=color, lw=1.0, alpha=0.7)
        if labels:
            middle = (seg.first_update + end) / 2
            ax.text(
                middle,
                1.01,  # just above the axes: no legend or curve can hide it
                f"#{seg.index}",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                clip_on=False,
                fontsize=9,
                fontweight="bold",
                color=color,
            )
    for update in series.checkpoints:
        ax.axvline(update, color="0.35", lw=0.8, ls=":", zorder=1)
    if series.checkpoints:
        ax.plot(
            series.checkpoints,
            [0.0] * len(series.checkpoints),
            marker="v",
            ls="none",
            color="0.2",
            markersize=6,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            zorder=3,
        )
        if labels and len(series.checkpoints) <= 16:
            for update in series.checkpoints:
                ax.text(
                    update,
                    0.02,
                    f" ckpt {update}",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    fontsize=7,
                    color="0.3",
                    va="bottom",
                    ha="right",
                )
    ax.set_xlim(lo, hi)
    ax.grid(True, alpha=0.25)


def _legend_handles(series: RunSeries) -> list[Any]:
    handles: list[Any] = [
        Patch(color=SEGMENT_COLORS[(s.index - 1) % len(SEGMENT_COLORS)], alpha=0.35, label=s.label())
        for s in series.segments
    ]
    if series.checkpoints:
        handles.append(Line2D([], [], color="0.2", marker="v", ls=":", label="complete checkpoint"))
    return handles


def _has_values(values: list[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", transform=ax.transAxes, ha="center", va="center", color="0.5")


def draw_loss(ax: Axes, s: RunSeries) -> None:
    if not _has_values(s.loss):
        return _no_data(ax, "loss")
    ax.plot(
        s.updates, s.loss, color="0.6", lw=0.9, marker="." if len(s.updates) <= 60 else None, label="loss"
    )
    ax.plot(s.updates, smooth(s.loss), color="#1F3B73", lw=2.0, label="loss (smoothed)")
    ax.set_ylabel("loss" + (f" (mean of {s.ranks} ranks)" if s.ranks > 1 else ""))
    ax.legend(loc="lower left", fontsize=8)  # a falling loss leaves that corner empty


def draw_objectives(ax: Axes, s: RunSeries) -> None:
    palette = ("#1F3B73", "#C96F16", "#2F7F5F", "#B23A48", "#7A4E9E", "#5A5A5A")
    drawn = {name: v for name, v in s.objectives.items() if _has_values(v)}
    if not drawn:
        return _no_data(ax, "per-objective loss")
    for i, (name, values) in enumerate(drawn.items()):
        color = palette[i % len(palette)]
        ax.plot(s.updates, values, color=color, lw=0.7, alpha=0.45)
        ax.plot(s.updates, smooth(values), color=color, lw=1.8, label=f"{name} (smoothed)")
    finite = [x for v in drawn.values() for x in v if math.isfinite(x)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")  # objectives of other magnitudes (0.014 and 0.35) each stay readable
    ax.set_ylabel("loss per objective" + (f" (mean of {s.ranks} ranks)" if s.ranks > 1 else ""))
    ax.legend(loc="lower left", fontsize=8)


def draw_lr(ax: Axes, s: RunSeries) -> None:
    if not _has_values(s.lr):
        return _no_data(ax, "learning rate")
    ax.plot(s.updates, s.lr, color="#B23A48", lw=1.6, drawstyle="steps-mid")
    ax.set_ylabel("learning rate")
    # Plain tick labels like 3e-04: matplotlib's shared offset text would collide with the panel title.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:.3g}"))


def _draw_rate(ax: Axes, s: RunSeries, values: list[float], what: str, label: str, color: str) -> None:
    if not _has_values(values):
        return _no_data(ax, what)
    ax.plot(s.updates, values, color=color, lw=1.2, marker="." if len(s.updates) <= 60 else None)
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)


def draw_update_time(ax: Axes, s: RunSeries) -> None:
    _draw_rate(ax, s, s.update_time, "update time", "update time (s, slowest rank)", "#2F7F5F")


def draw_samples_per_s(ax: Axes, s: RunSeries) -> None:
    _draw_rate(ax, s, s.samples_per_s, "samples/s", "samples / s", "#7A4E9E")


def draw_exposures(ax: Axes, s: RunSeries) -> None:
    if not s.exposure_updates:
        return _no_data(ax, "exposure")
    ax.plot(s.exposure_updates, s.distinct_samples, color="#C96F16", lw=2.0, label="distinct samples")
    ax.plot(
        s.exposure_updates, s.total_exposures, color="0.45", lw=1.0, ls="--", label="exposures (with repeats)"
    )
    if s.manifest_size:
        seen = s.distinct_samples[-1] / s.manifest_size
        label = f"manifest: {s.manifest_size} samples ({seen:.0%} seen)"
        if seen >= 0.3:
            ax.axhline(s.manifest_size, color="0.2", lw=0.8, ls="-.", label=label)
        else:  # a line far above the curve would flatten it; say it in words instead
            ax.plot([], [], ls="none", label=label)
    ax.set_ylabel("samples seen")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)


Drawer = Callable[[Axes, RunSeries], None]

# name -> (title, drawer); the order is the order of the overview's panels and of the HTML page.
PANELS: dict[str, tuple[str, Drawer]] = {
    "loss": ("Loss (raw and smoothed)", draw_loss),
    "lr": ("Learning rate", draw_lr),
    "update_time": ("Update time", draw_update_time),
    "samples_per_s": ("Throughput", draw_samples_per_s),
    "exposures": ("Exposure progress", draw_exposures),
}


OBJECTIVES = ("Loss per objective (raw and smoothed)", draw_objectives)


def panels_for(series: RunSeries) -> dict[str, tuple[str, Drawer]]:
    """The panels of this run: PANELS, and after the loss the per-objective losses when any was logged."""
    if not series.objectives:
        return dict(PANELS)
    out = {"loss": PANELS["loss"], "objectives": OBJECTIVES}
    out.update({k: v for k, v in PANELS.items() if k != "loss"})
    return out


def _title(series: RunSeries) -> str:
    return (
        f"{series.run.path.name}: updates {series.updates[0]}–{series.updates[-1]}, "
        f"{len(series.segments)} segment(s), {len(series.checkpoints)} checkpoint(s)"
    )


def _legend_inches(series: RunSeries) -> float:
    """Height to keep free under the axes for the segment legend (two columns, about 0.2 inch a row)."""
    entries = len(series.segments) + bool(series.checkpoints)
    return 0.22 * math.ceil(entries / 2) + 0.1 if entries else 0.0


def _save(fig: Any, path: Path) -> None:
    """The figure's PNG in place of `path`, by an atomic rename: a link planted there is replaced, never
    written through (savefig opened the path and wrote wherever it led)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    atomic_write_bytes(path, buf.getbuffer())


def _finish(fig: Any, series: RunSeries, path: Path) -> Path:
    handles = _legend_handles(series)
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(2, len(handles)), fontsize=8, frameon=False)
    _save(fig, path)
    return path


def draw_overview(series: RunSeries, path: Path) -> Path:
    """All panels stacked on one shared update axis."""
    panels = panels_for(series)
    rows = len(panels)
    height = 2.4 * rows + _legend_inches(series) + 0.8
    fig = Figure(figsize=(12, height))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, drawer) in zip(axes, panels.values()):
        drawer(ax, series)
        _decorate(ax, series, labels=ax is axes[0])
        ax.set_title(title, fontsize=10, loc="left", pad=16 if ax is axes[0] else 6)
    axes[-1].set_xlabel("update")
    fig.suptitle(_title(series), fontsize=12)
    fig.tight_layout(rect=(0, _legend_inches(series) / height, 1, 1 - 0.25 / height))
    return _finish(fig, series, path)


def draw_panel(name: str, series: RunSeries, path: Path) -> Path:
    """One quantity against the update, with the same segment shading and checkpoint marks."""
    title, drawer = panels_for(series)[name]
    height = 4.0 + _legend_inches(series)
    fig = Figure(figsize=(10, height))
    ax = fig.subplots()
    drawer(ax, series)
    _decorate(ax, series, labels=True)
    ax.set_title(f"{title} — {series.run.path.name}", fontsize=11, loc="left", pad=16)
    ax.set_xlabel("update")
    fig.tight_layout(rect=(0, _legend_inches(series) / height, 1, 1))
    return _finish(fig, series, path)


def draw_validation(series: RunSeries, path: Path, max_metrics: int = 6) -> Path:
    """Each validation metric against the checkpoint's update (as the LingBot card's table); failed ones marked."""
    names = series.validation_metrics()[:max_metrics] or ["(no numeric metric)"]
    fig = Figure(figsize=(10, 2.8 * len(names) + 0.8))
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)
    failed = [p.update for p in series.validation if p.status != "ok"]
    for ax, name in zip(axes[:, 0], names):
        points = [(p.update, p.metrics[name]) for p in series.validation if name in p.metrics]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, color="#1F3B73", marker="o", lw=1.6)
            for x, y in points:
                ax.annotate(
                    f"{y:.4g}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
                )
        for update in failed:
            ax.axvline(update, color="#C0392B", lw=1.0, ls="--", alpha=0.7)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.25)
    if failed:
        axes[0, 0].plot([], [], color="#C0392B", ls="--", label="validation failed or interrupted")
        axes[0, 0].legend(loc="best", fontsize=8)
    axes[-1, 0].set_xticks(sorted({p.update for p in series.validation}))
    axes[-1, 0].set_xlabel("update (checkpoint)")
    fig.suptitle(f"{series.run.path.name}: validation of {len(series.validation)} checkpoint(s)", fontsize=11)
    fig.tight_layout()
    _save(fig, path)
    return path
