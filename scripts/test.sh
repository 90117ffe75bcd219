#!/usr/bin/env bash
# Run the test suite: installs what is missing on first use (see scripts/env.sh), then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k advantage` or `bash scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec "$PY" -m pytest -q "$@"
