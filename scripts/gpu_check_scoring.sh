#!/usr/bin/env bash
# Former name of scripts/gpu_check.sh, which now runs every GPU check (advantage and scoring); kept as an alias.
exec bash "$(dirname "$0")/gpu_check.sh" "$@"
