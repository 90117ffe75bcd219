# Sourced by train_igpo.sh and scripts/test.sh: pick a Python that has what the project needs, else make .venv.
# Sets PY. Idempotent and fast once installed (a stamp records the hash of the install inputs).
_igpo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_igpo_hash="$(cat "$_igpo_root/requirements.txt" "$_igpo_root/requirements-common.txt" "$_igpo_root/pyproject.toml" | sha256sum | cut -c1-16)"
_igpo_check='import importlib.metadata as m, verl, torch, transfer_queue, fastapi, uvicorn, bm25s, httpx, json5, numba, pytest, pytest_asyncio, matplotlib
assert any(e.name == "igpo" for e in m.entry_points(group="verl.plugins")), "igpo is not installed as a verl plugin"'

_igpo_has_all() { "$1" -c "$_igpo_check" >/dev/null 2>&1; }

if [ -x "$_igpo_root/.venv/bin/python" ] && [ "$(cat "$_igpo_root/.venv/.igpo-stamp" 2>/dev/null)" = "$_igpo_hash" ]; then
    PY="$_igpo_root/.venv/bin/python"
elif [ ! -d "$_igpo_root/.venv" ] && command -v python3 >/dev/null && _igpo_has_all python3; then
    PY="$(command -v python3)"
else
    echo "igpo: installing into $_igpo_root/.venv (first run only; a few minutes)..." >&2
    [ -x "$_igpo_root/.venv/bin/python" ] || python3 -m venv "$_igpo_root/.venv"
    "$_igpo_root/.venv/bin/python" -m pip install -q --upgrade pip >&2
    "$_igpo_root/.venv/bin/python" -m pip install -q -r "$_igpo_root/requirements.txt" >&2
    "$_igpo_root/.venv/bin/python" -m pip install -q --no-deps -e "$_igpo_root" >&2
    if ! _igpo_has_all "$_igpo_root/.venv/bin/python"; then
        echo "igpo: the install finished but imports still fail; run: $_igpo_root/.venv/bin/python -c '$_igpo_check'" >&2
        return 1 2>/dev/null || exit 1
    fi
    echo "$_igpo_hash" > "$_igpo_root/.venv/.igpo-stamp"
    PY="$_igpo_root/.venv/bin/python"
fi
export PY
