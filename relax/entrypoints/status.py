"""`relax-status RUN_DIR`: the autoscaler's current status of a run (--autoscaler-config), from the
RUN_DIR/autoscaler_status.json its rollout manager keeps (relax/observability/autoscaler_status.py): a header
(updated when, active engines within [min, max], the scaling under way), one line per engine with its last
scraped metrics, then the decisions newest first (time, action, engines before->after, reason, outcome).
`--json` prints the file as it is; `--watch SECONDS` shows it again every SECONDS until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import time

from relax.observability.autoscaler_status import StatusFileError, format_status, read_status, read_status_text

PROG = "relax-status"


def _show(run: str, as_json: bool, last: int) -> None:
    if as_json:
        _, text = read_status_text(run)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        _, status = read_status(run)
        print(format_status(status, last=last, source=run))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Show the autoscaler's status of a Relax run (--autoscaler-config): its engines "
        "with their last metrics and every scaling decision with its reason, from RUN_DIR/autoscaler_status.json.")
    parser.add_argument("run", metavar="RUN_DIR", help="the run's --output-dir (or its autoscaler_status.json)")
    parser.add_argument("--json", action="store_true", help="print the status file as it is (JSON)")
    parser.add_argument("--watch", metavar="SECONDS", type=float, default=None,
                        help="show the status again every SECONDS until interrupted")
    parser.add_argument("--last", metavar="N", type=int, default=20,
                        help="the N newest decisions (default 20; 0: all)")
    args = parser.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch: SECONDS must be positive")
    try:
        _show(args.run, args.json, args.last)
    except StatusFileError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.watch is None:
        return 0
    clear = "\033[H\033[J" if sys.stdout.isatty() and not args.json else ""
    try:
        while True:
            time.sleep(args.watch)
            if clear:
                sys.stdout.write(clear)
            elif not args.json:
                print()
            try:
                _show(args.run, args.json, args.last)
            except StatusFileError as exc:  # e.g. the folder went away: say so and keep watching
                print(f"{PROG}: {exc}", flush=True)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
