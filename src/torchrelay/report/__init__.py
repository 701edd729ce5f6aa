"""`torchrelay report`: PNG plots and one self-contained HTML page of a run, segments and checkpoints marked."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from torchrelay.errors import PathError, UnsafeInput
from torchrelay.paths.rundir import RunDir
from torchrelay.report.series import ReportError, RunSeries, read_series
from torchrelay.util.safepath import is_inside

__all__ = ["ReportError", "ReportResult", "RunSeries", "read_series", "render"]


@dataclass(frozen=True, slots=True)
class ReportResult:
    """Where the report was written: the HTML page, the overview PNG and one PNG per quantity."""

    out_dir: Path
    html: Path
    overview: Path
    plots: dict[str, Path]
    segments: int
    updates: int

    def pngs(self) -> list[Path]:
        """Every PNG written, the overview first."""
        return [self.overview, *self.plots.values()]


def render(
    run_dir: str | os.PathLike[str] | RunDir, out_dir: str | Path | None = None, *, audit: str | None = None
) -> ReportResult:
    """Draw the run in `run_dir` into `out_dir` (default RUN_DIR/report): overview.png, one PNG per plot, report.html.

    `audit`: the resumability audit's verdict line for the page (the `report` command looks it up)."""
    # Imported here so that `import torchrelay.report` stays cheap for tools that only read series.
    from torchrelay.report.html import write_html
    from torchrelay.report.plots import draw_overview, draw_panel, draw_validation, panels_for

    run = RunDir.of(run_dir)
    series = read_series(run)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    if out_dir is None and (out.is_symlink() or not is_inside(run.path, out)):
        # the run directory's own folder, not one a link in it leads to (the user's --out may be a link of theirs)
        raise UnsafeInput(
            f"{out} is a symbolic link (to {os.path.realpath(out)}); refusing to write the report through it",
            hint="remove the link, or pass --out DIR",
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error = PathError if exc.errno != errno.ENOSPC else ReportError
        raise error(
            f"{out}: cannot create the report directory ({exc.strerror})",
            hint="pass --out DIR somewhere writable (a directory, or a path that does not exist yet)",
        ) from exc
    overview = draw_overview(series, out / "overview.png")
    panels = panels_for(series)
    plots = {name: draw_panel(name, series, out / f"{name}.png") for name in panels}
    if series.validation:  # only runs with validation records get the plot (and the page its table)
        plots["validation"] = draw_validation(series, out / "validation.png")
    titles = {name: title for name, (title, _) in panels.items()} | {
        "validation": "Validation (metric vs update)"
    }
    images = {"overview": ("Overview", overview)} | {
        name: (titles[name], path) for name, path in plots.items()
    }
    page = write_html(series, images, out / "report.html", audit=audit)
    return ReportResult(
        out_dir=out,
        html=page,
        overview=overview,
        plots=plots,
        segments=len(series.segments),
        updates=len(series.updates),
    )
