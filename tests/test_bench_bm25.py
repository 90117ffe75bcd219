"""scripts/bench_bm25.py on a small corpus: both sides run, their top-5 hits agree, the last line is the ratios."""
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_bm25.py"


def test_bench_bm25_compares_with_bm25s_and_prints_ratios(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--passages", "3000", "--vocab", "20000", "--queries", "40",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "load average at start" in lines[0]
    assert any(line.startswith("build_s: ours / bm25s median") and "3 rounds" in line for line in lines)
    assert "0 queries with different hits" in run.stdout
    assert lines[-2].startswith("absolute (this machine, moves with its speed): passages=3000 build_s=")
    m = re.fullmatch(r"bm25: passages=3000 build_vs_bm25s=([\d.]+) query_p50_vs_bm25s=([\d.]+) "
                     r"query_p95_vs_bm25s=([\d.]+) peak_rss_vs_bm25s=([\d.]+) topk_max_abs_diff=([\d.e+-]+) "
                     r"topk_mismatches=0", lines[-1])
    assert m, lines[-1]
    assert all(float(x) > 0 for x in m.groups()[:4])
    assert float(m.group(5)) <= 1e-4
