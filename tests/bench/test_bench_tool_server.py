"""scripts/bench/bench_tool_server.py at a small size: the real tool server behind a slow fake upstream; the concurrency
limit and one upstream call per query hold, and the last line carries the two ratios."""
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_tool_server.py"


def test_bench_tool_server_reports_throughput_and_cache_hits_against_bare_round_trips():
    run = subprocess.run([sys.executable, str(SCRIPT), "--requests", "32", "--concurrency", "4", "--latency", "0.05",
                          "--trials", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "load average at start" in lines[0]
    assert "upstream calls=96 (want 96)" in run.stdout  # 3 trials x 32 distinct queries; every repeat was a hit
    peak = int(re.search(r"peak upstream concurrency=(\d+) \(limit 4\)", run.stdout).group(1))
    assert 1 <= peak <= 4
    bare_runs = re.search(r"^bare   s per run: +([\d. ]+) ->", run.stdout, re.M).group(1).split()
    assert len(bare_runs) == 15  # 5 (all-hits, bare) pairs after each of the 3 cold runs
    assert lines[-2].startswith("absolute (this machine, moves with its speed): cache_hit_speedup")
    m = re.fullmatch(r"tool server: throughput_vs_bound=([\d.]+) cache_hit_vs_bare_http=([\d.]+)", lines[-1])
    assert m, lines[-1]
    # 8 rounds of 50 ms at best: the ratio to the bound cannot pass 1 (a swapped ratio would read ~1/throughput)
    assert 0 < float(m.group(1)) <= 1.0
    assert float(m.group(2)) > 0
