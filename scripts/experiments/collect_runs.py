"""Copy a comparison's finished runs from the clone it runs in into this checkout, in the form kept in git.

A long comparison (``scripts/experiments/compare_methods.py``) runs in a separate clone so that its commit stays
fixed while the checkout moves on. What a run leaves in the clone is large (trajectory logs 2 MB, the exported policy,
TensorBoard files) and names the clone's path; what git keeps of it is what the summaries read, written so that a
fresh clone with ``--resume`` counts the run as finished:

    train.log, console.log, interval.txt, wall_s.txt, peak_rss_mb.txt   as they are, the clone's path as <clone>
    <name>.earlier                                                      the same, for a run continued from a checkpoint
    tool_server.log.gz                                                  the tool server's log, gzipped (read by nothing)
    turns.csv.gz                                                        the run's per-turn rows
                                                                        (``summarize_turn_credit.py``)

A run is copied once it is finished (its log has the final step, ``wall_s.txt`` exists) and not yet here; the rest are
left alone, so running this again while the comparison goes on adds what finished since.

Usage:
    python scripts/experiments/collect_runs.py --clone ../rows --comparison results/turn_credit/A2 [--steps 12]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import summarize_turn_credit as stc  # noqa: E402  (the per-turn rows)
from comparison_runs import Run, load_finished  # noqa: E402
TEXT = ("train.log", "console.log", "interval.txt", "wall_s.txt", "peak_rss_mb.txt")


def collect(clone: Path, comparison: Path, steps: int, into: Path = ROOT) -> list[str]:
    """Copy the finished runs of ``clone/comparison/runs`` not yet in ``into/comparison/runs``; their names."""
    source, target = clone / comparison / "runs", into / comparison / "runs"
    if not source.is_dir():
        raise SystemExit(f"collect_runs: no runs/ folder at {source}; give --clone the clone's root and --comparison "
                         f"the comparison's folder relative to it (e.g. results/turn_credit/A2)")
    if source.resolve() == target.resolve():
        raise SystemExit(f"collect_runs: --clone {clone} is this checkout; give the clone the comparison runs in")
    copied = []
    for directory in sorted(source.glob("*-s*")):
        method, _, seed = directory.name.rpartition("-s")
        run = Run(method, int(seed), directory)
        out = target / directory.name
        if (out / "wall_s.txt").is_file() or not load_finished(run, steps):
            continue
        stc.run_turns(run)  # from the trajectory log, written to the clone's turns.csv.gz (read there if no log)
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted(directory.iterdir()):
            if not path.is_file():
                continue
            if path.name in TEXT or path.name.endswith(".earlier"):
                (out / path.name).write_text(_scrub(path.read_text(), clone))
            elif path.name == "tool_server.log":
                with gzip.open(out / "tool_server.log.gz", "wt") as handle:
                    handle.write(_scrub(path.read_text(), clone))
        if (directory / stc.RUN_TURNS).is_file():
            shutil.copy(directory / stc.RUN_TURNS, out / stc.RUN_TURNS)
        copied.append(directory.name)
    return copied


def _scrub(text: str, clone: Path) -> str:
    return text.replace(str(clone.resolve()), "<clone>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clone", type=Path, required=True, help="the root of the clone the comparison runs in")
    parser.add_argument("--comparison", type=Path, required=True,
                        help="the comparison's folder relative to the repository root, e.g. results/turn_credit/A2")
    parser.add_argument("--steps", type=int, default=12, help="the comparison's steps (a finished run logged this one)")
    args = parser.parse_args()
    copied = collect(args.clone, args.comparison, args.steps)
    print(f"collect_runs: {len(copied)} finished run(s) copied into {args.comparison}/runs: "
          f"{', '.join(copied) or 'none new'}")


if __name__ == "__main__":
    main()
