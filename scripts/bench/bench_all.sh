#!/usr/bin/env bash
# Runs every benchmark (scripts/bench/bench_*.py) once, one after another, and writes results/bench/<date>.md (date from
# `date +%F`; a second run on the same day writes <date>-2.md, and so on): the machine, each script's last line and
# wall time, and each script's full output. The target is <= 15 minutes on 2 cores: on an idle 2-core AMD EPYC runs
# 16-18 took 11.9-12.3 minutes (7.9-8.5 of them bench_scoring); on 2 cores shared with another engineer's
# jobs (load 2-5) 22-27 minutes, 17-23 of them bench_scoring's memory part (KV reuse's chunked HF prefill at 32K takes
# 1-3 minutes per scoring there; see results/bench/).
#
# Usage: scripts/bench/bench_all.sh            (exit status 1 if any benchmark failed; the others still run)
# bench_bm25 runs on 100,000 synthetic passages here (its default is 1,000,000; each round builds both its side and
# plain bm25s's in-memory index).
# bench_step runs SmolLM2 only, one round (its defaults: the tiny model too, two rounds; 444-1,248 s on shared cores):
# the last line, ig_step_overhead on SmolLM2 with actor-side scoring, is the same figure; the tiny model's scoring is
# per-call overhead that swung 2-35 s with the load and is not the measure (results/bench/2026-12-04-step.md), and a
# second round repeats the method phases only (the shared ones, ~88% of a step, are timed once either way), so the
# spread shows between two bench_all runs instead. Measured alone: 575 s wall, 366 s CPU at load 4.8-5.4 (its phases
# 2-3x their quiet-machine times); on an idle machine ~4-5 minutes (not measured), so the whole run ~14 minutes.
# bench_scoring's memory part runs KV reuse's chunked prefill at 256 tokens only (its default adds 1,024): the
# 256-token chunk set every *_worst ratio of the last line in all 18 runs under results/bench/ (32K: 0.42-0.66
# against 0.27-0.48 for 1,024; 4K: 0.86-2.49 against 0.57-1.58), and the 1,024-token one cost ~140 s (3 scorings of
# ~46 s at 32K).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/env.sh

declare -A ARGS=([bench_bm25]="--passages 100000" [bench_step]="--models smollm2 --rounds 1" [bench_scoring]="--chunks 256")
ORDER=(bench_advantage bench_scoring bench_infopo bench_agent_loop bench_tool_server bench_bm25 bench_step)
for script in scripts/bench/bench_*.py; do  # a new benchmark is never skipped silently
    name=$(basename "$script" .py)
    [[ " ${ORDER[*]} " == *" $name "* ]] || ORDER+=("$name")
done

mkdir -p results/bench
day=$(date +%F)
out=results/bench/$day.md
n=2
while [[ -e $out ]]; do out=results/bench/$day-$n.md; n=$((n + 1)); done
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

started=$(date +%s)
{
    echo "# Benchmarks, $(date '+%F %H:%M %Z')"
    echo
    echo "- machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores," \
         "$(free -g | awk '/^Mem:/ {print $2}') GiB RAM; load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- scripts igpo/core tests || echo ' (+ uncommitted changes)')"
    echo "- python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
    echo
    echo "| script | last line | wall s | exit |"
    echo "|---|---|---|---|"
} > "$out.tmp"

status=0
declare -A RC
for name in "${ORDER[@]}"; do
    t0=$(date +%s)
    # shellcheck disable=SC2086  # ARGS holds space-separated options
    "$PY" "scripts/bench/$name.py" ${ARGS[$name]:-} > "$logs/$name.out" 2> "$logs/$name.err"
    rc=$?
    RC[$name]=$rc
    wall=$(($(date +%s) - t0))
    last=$(tail -n 1 "$logs/$name.out")
    [[ $rc -eq 0 ]] || { status=1; last="FAILED: $(tail -n 1 "$logs/$name.err")"; }
    echo "| \`$name.py ${ARGS[$name]:-}\` | \`$last\` | $wall | $rc |" >> "$out.tmp"
    echo "$name: rc=$rc ${wall}s: $last" >&2
done

{
    echo
    echo "Total wall time: $(($(date +%s) - started)) s; load average at the end $(cut -d' ' -f1-3 /proc/loadavg)."
    for name in "${ORDER[@]}"; do
        echo
        echo "## $name"
        echo
        echo '```'
        cat "$logs/$name.out"
        [[ ${RC[$name]} -eq 0 ]] || tail -n 20 "$logs/$name.err"
        echo '```'
    done
} >> "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out" >&2
exit $status
