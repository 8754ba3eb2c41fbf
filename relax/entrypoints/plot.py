"""`relax-plot RUN_DIR`: PNGs of reward, response length, loss, KL and the step-time breakdown of a run, from its
metrics.jsonl (relax/observability/plot.py)."""

from __future__ import annotations

import argparse
import sys

from relax.observability.plot import VIEWS, MetricsFileError, plot_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relax-plot", description="Plot a Relax run's metrics.jsonl as PNG files: "
        + ", ".join(f"{stem}.png" for stem in VIEWS) + " and overview.png (all of them).")
    parser.add_argument("run", metavar="RUN_DIR", help="the run's --output-dir (or its metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written, notes = plot_run(args.run, args.out)
    except MetricsFileError as exc:
        print(f"relax-plot: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"relax-plot: note: {note}", file=sys.stderr)
    if not written:
        print(f"relax-plot: error: nothing to plot in {args.run}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
