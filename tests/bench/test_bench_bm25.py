"""scripts/bench/bench_bm25.py on a small corpus: both sides run, their top-5 hits agree, the last line is the
ratios."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_bm25.py"


def test_bench_bm25_compares_with_bm25s_and_prints_ratios(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--passages", "3000", "--vocab", "20000", "--queries", "40",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "load average at start" in lines[0]
    assert any(line.startswith("build_s: ours / bm25s median") and "3 rounds" in line for line in lines)
    assert "0 queries with different hits" in run.stdout
    assert int(re.search(r"\((\d+) hits compared by id", run.stdout).group(1)) > 0
    assert lines[-2].startswith("absolute (this machine, moves with its speed): passages=3000 build_s=")
    m = re.fullmatch(r"bm25: passages=3000 build_vs_bm25s=([\d.]+) query_p50_vs_bm25s=([\d.]+) "
                     r"query_p95_vs_bm25s=([\d.]+) peak_rss_vs_bm25s=([\d.]+) topk_max_abs_diff=([\d.e+-]+) "
                     r"topk_mismatches=0", lines[-1])
    assert m, lines[-1]
    assert all(float(x) > 0 for x in m.groups()[:4])
    assert float(m.group(5)) <= _compare()[1]  # SCORE_TOL
    for name, ratio in zip(("build_s", "query_p50_ms", "query_p95_ms", "peak_rss_gb"), m.groups()[:4]):
        _assert_ratio_is_ours_over_bm25s(run.stdout, name, float(ratio))


def _assert_ratio_is_ours_over_bm25s(stdout: str, name: str, ratio: float) -> None:
    """Each round's ratio lies between ours' fastest over bm25s's slowest and the reverse, and so does their median:
    a ratio computed the wrong way round (bm25s / ours) falls outside unless both sides are equal."""
    number = r"([\d.]+)"
    line = re.search(rf"^{name}: ours / bm25s median {number} .*?; ours median {number} \(min {number}, max {number}, "
                     rf"\d+ rounds\); bm25s median {number} \(min {number}, max {number}, ", stdout, re.M)
    assert line, f"no {name} line"
    _, _, ours_min, ours_max, _, base_min, base_max = (float(x) for x in line.groups())
    slack = 0.005  # the sides are printed to 2 decimals
    low = max(ours_min - slack, 0.0) / (base_max + slack)
    high = (ours_max + slack) / max(base_min - slack, 1e-9)
    assert low <= ratio <= high, (name, ratio, low, high)


def _compare():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_bm25", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    spec.loader.exec_module(module)
    return module.compare_topk, module.SCORE_TOL


def test_compare_topk_allows_ties_at_the_fifth_score_only():
    compare, tol = _compare()
    ours = [("a", 9.0), ("b", 8.0), ("c", 7.0), ("d", 5.0), ("e", 5.0)]
    tied = [("a", 9.0), ("b", 8.0), ("c", 7.0), ("d", 5.0), ("f", 5.0)]  # another passage tied at the 5th
    assert compare(ours, tied) == (0.0, False, 3)
    swapped = [("a", 9.0), ("x", 8.0), ("c", 7.0), ("d", 5.0), ("e", 5.0)]  # a different passage above the tie
    assert compare(ours, swapped)[1]
    near = [("a", 9.0), ("b", 8.0), ("c", 7.0), ("d", 5.0 + 10 * tol), ("f", 5.0)]  # e left out, d just above the tie
    assert compare(ours, near)[1]
    assert compare(ours, ours[:4])[1]  # a hit missing
    diff, differs, compared = compare([("a", 1.0 + tol / 4)], [("a", 1.0)])  # within tolerance: the only hit is the tie
    assert diff == pytest.approx(tol / 4) and not differs and compared == 0
    assert compare([], []) == (0.0, False, 0)
