"""Write one self-contained HTML page: the segment table, the checkpoints and every plot embedded as base64."""

from __future__ import annotations

import base64
import datetime as dt
import html
from pathlib import Path

from torchrelay.paths.layout import checkpoint_label
from torchrelay.report.series import RunSeries, Segment
from torchrelay.util.durable import atomic_write_text


def _when(stamp: object) -> str:
    if not isinstance(stamp, int | float):
        return "—"
    return dt.datetime.fromtimestamp(float(stamp), tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _segment_row(seg: Segment) -> str:
    cells = [
        f"#{seg.index}",
        seg.segment_id,
        seg.job or "—",
        ", ".join(seg.hosts) or "—",
        "—" if seg.world_size is None else str(seg.world_size),
        f"{seg.first_update}–{seg.last_update if seg.last_update is not None else '…'}",
        "start" if seg.resumed_from is None else checkpoint_label(seg.resumed_from),
        seg.ended,
        "—" if seg.exit_code is None else str(seg.exit_code),
        "; ".join(f"{k}: {old} → {new}" for k, (old, new) in _pairs(seg.runtime_changes)) or "—",
        seg.numerics or "not recorded",
        "; ".join(([seg.layout_change] if seg.layout_change else []) + seg.notes) or "—",
    ]
    return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


def _pairs(changes: dict[str, object]) -> list[tuple[str, tuple[object, object]]]:
    """history.jsonl's {field: [old, new]}; anything else is shown as it is."""
    out = []
    for key, value in changes.items():
        pair = tuple(value) if isinstance(value, list | tuple) and len(value) == 2 else ("?", value)
        out.append((key, (pair[0], pair[1])))
    return out


def _image(title: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure id="{html.escape(path.stem)}"><figcaption>{html.escape(title)}</figcaption>'
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>'
    )


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f2f2f2; }
figure { margin: 1.2em 0; } figcaption { font-weight: bold; margin-bottom: 0.3em; }
img { max-width: 100%; border: 1px solid #ddd; }
.muted { color: #777; }
"""


def write_html(
    series: RunSeries, images: dict[str, tuple[str, Path]], path: Path, audit: str | None = None
) -> Path:
    """Write the page; `images` maps a plot name to (title, PNG path), embedded in that order."""
    last = series.updates[-1]
    loss = series.loss[-1]
    summary = (
        f"updates {series.updates[0]}–{last} logged by {series.ranks} rank(s); "
        f"last loss {loss:.4g}; {len(series.segments)} segment(s); "
        f"{len(series.checkpoints)} complete checkpoint(s)"
    )
    if series.distinct_samples:
        of = f" of {series.manifest_size}" if series.manifest_size else ""
        summary += f"; {series.distinct_samples[-1]}{of} distinct samples seen"
    head = [
        "#",
        "segment",
        "job",
        "hosts",
        "world size",
        "updates",
        "resumed from",
        "ended",
        "exit code",
        "runtime changes",
        "numerics",
        "notes",
    ]
    rows = "\n".join(_segment_row(s) for s in series.segments)
    segments = (
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>\n" + rows + "</table>"
        if series.segments
        else '<p class="muted">no history.jsonl: no segments recorded</p>'
    )
    started = _when(min(_starts(series), default=None))
    checkpoints = ", ".join(checkpoint_label(n) for n in series.checkpoints) or "none"
    figures = "\n".join(_image(title, png) for title, png in images.values())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>torchrelay report: {html.escape(series.run.path.name)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>torchrelay report: {html.escape(series.run.path.name)}</h1>
<p class="muted">{html.escape(str(series.run.path.resolve()))} · first segment started {started}</p>
<p>{html.escape(summary)}</p>
<p>Resumability audit: {html.escape(audit or "none recorded for this run's code (run `torchrelay audit`)")}</p>
<h2>Segments</h2>
{segments}
<p>{html.escape(_numerics_line(series))}</p>
<h2>Checkpoints</h2>
<p>{html.escape(checkpoints)}</p>
{_validation_table(series)}
<h2>Plots</h2>
{figures}
</body></html>
"""
    atomic_write_text(path, page)  # a link planted at `path` is replaced, never written through
    return path


def _validation_table(series: RunSeries) -> str:
    if not series.validation:
        return ""
    names = series.validation_metrics()
    head = ["checkpoint", "status", *names, "seconds", "reason"]
    rows = []
    for p in series.validation:
        cells = [checkpoint_label(p.update), p.status]
        cells += [f"{p.metrics[n]:.6g}" if n in p.metrics else "—" for n in names]
        cells += [f"{p.seconds:.1f}", p.reason or "—"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<h2>Validation</h2>\n<table>{header}\n" + "\n".join(rows) + "</table>"


def _starts(series: RunSeries) -> list[float]:
    return [s.started for s in series.segments if s.started is not None]


def _numerics_line(series: RunSeries) -> str:
    """Bit-for-bit comparison holds within one numerics identity: say how many the segments ran with."""
    kinds = {s.numerics for s in series.segments if s.numerics}
    if not kinds:
        return "Numerics: not recorded (segments written before torchrelay recorded them)."
    if len(kinds) == 1:
        return "Numerics: every recorded segment ran with one identity; bit-for-bit comparison holds across them."
    return (
        f"Numerics: the segments ran with {len(kinds)} identities; bit-for-bit comparison holds only between "
        "segments of one identity (docs/NUMERICS.md)."
    )
