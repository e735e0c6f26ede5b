"""Every committed benchmark plot is drawn from the committed JSON, and says what it shows.

Each PNG of ``benchmarks/results`` records the SHA-256 of the JSON it was drawn from (a PNG
text chunk, :mod:`benchmarks.plot_sources`); a plot left behind when its JSON changed fails
here. Regenerate them with ``python -m pympar bench --report-only --out benchmarks/results``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpi_helpers import WORLD

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import plot_sources, report  # noqa: E402
from benchmarks.plot_mappings import SHOWN  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.mark.mpi(min_size=1)
def test_committed_plots_are_drawn_from_the_committed_json():
    pngs = sorted(p.name for p in RESULTS.glob("*.png"))
    assert pngs, f"no plots in {RESULTS}"
    stale = plot_sources.stale_plots(RESULTS)
    assert not stale, ("stale plots (run python -m pympar bench --report-only --out "
                       f"benchmarks/results): {stale}")


def _mappings_sample():
    def row(op, nbytes, raw, ours, communicates=True):
        return {"op": op, "bytes": nbytes, "communicates": communicates, "raw_us": raw,
                "mpi_us": raw, "pympar_us": ours, "ratio": ours / raw, "extra_us": ours - raw}
    rows = []
    for nbytes in (1024, 2 ** 20):
        rows += [row(op, nbytes, 10.0, 10.0 * (1.1 + i / 10)) for i, op in enumerate(SHOWN)]
        rows.append(row("copy_to_all", nbytes, 0.1, 1.0, communicates=False))
    rows.append(row("all_reduce fresh", 2 ** 20, 10.0, 31.0))  # the worst that communicates
    return {"ranks": 2, "dtype": "float32", "repeats": 3, "mpi": "MPI", "rows": rows}


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(WORLD.size > 1, reason="draws the plots once, in the single-rank run")
def test_mappings_plot_ranks_only_what_communicates_and_records_its_json(tmp_path,
                                                                         saved_figures):
    (tmp_path / "mappings.json").write_text(json.dumps(_mappings_sample()))
    report.write_report(tmp_path)
    fig = saved_figures["mappings.png"]
    time_ax, _, ratio_ax, extra_ax = fig.axes
    legend = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert legend == [*SHOWN, "pympar", "raw mpi4py"], legend
    # The identity (10x: 1 us against 0.1 us) is not the worst: 3.10x is, as in the JSON.
    notes = [t.get_text() for t in ratio_ax.texts]
    assert notes == ["worst: all_reduce fresh\n1 MiB, 3.10x"], notes
    band = ratio_ax.collections[0].get_paths()[0].vertices[:, 1]
    assert max(band) == pytest.approx(3.1) and "7 operations that communicate" in \
        ratio_ax.get_title()
    (line,) = [ln for ln in extra_ax.get_lines() if ln.get_label() == "copy_to_all"]
    assert list(line.get_ydata()) == pytest.approx([0.9, 0.9]), "pympar - raw in us"
    # The PNG records the JSON's digest; any change to the JSON makes it stale.
    assert plot_sources.stale_plots(tmp_path) == []
    recorded = plot_sources.recorded_sources(tmp_path / "mappings.png")
    assert list(recorded) == ["mappings.json"] and len(recorded["mappings.json"]) == 64
    (tmp_path / "mappings.json").write_text(json.dumps(_mappings_sample(), indent=1))
    assert plot_sources.stale_plots(tmp_path) == [
        "mappings.png: drawn from other contents of mappings.json"]
    (tmp_path / "mappings.json").unlink()
    assert plot_sources.stale_plots(tmp_path) == [
        "mappings.png: drawn from other contents of mappings.json"]


@pytest.mark.mpi(min_size=1)
def test_plots_without_a_digest_or_a_known_source_are_stale(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in ("mlp.png", "new.png"):
        fig, _ = plt.subplots()
        fig.savefig(tmp_path / name)
        plt.close(fig)
    (tmp_path / "mlp.json").write_text("{}")
    assert plot_sources.stale_plots(tmp_path) == [
        "mlp.png: records no JSON digest (drawn by an older report)",
        "new.png: no JSON is known to draw it (benchmarks.plot_sources)"]
    (tmp_path / "bad.png").write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match="not a PNG"):
        plot_sources.png_text(tmp_path / "bad.png")
