#!/usr/bin/env bash
# Each turn-credit design through the real trainer on the chain task, 2 steps (issue 72's done-when); the console of
# each run is kept beside this script. Run from the repository root: bash results/turn_credit2/designs_e2e/run.sh
set -uo pipefail
here=results/turn_credit2/designs_e2e
export MODEL_PATH="${MODEL_PATH:-$PWD/results/turn_credit/model_A2}"
run() {
    local name=$1; shift
    local start=$SECONDS
    bash train_igpo.sh demo.task=chain trainer.total_training_steps=2 "$@" > "$here/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s: bash train_igpo.sh demo.task=chain trainer.total_training_steps=2 $*" \
        | tee -a "$here/exits.txt"
}
: > "$here/exits.txt"
run oracle_uncentred algorithm.adv_estimator=oracle algorithm.igpo.norm_mode=uncentred algorithm.igpo.ig_weight=0.25
run oracle_potential algorithm.adv_estimator=oracle algorithm.igpo.norm_mode=potential algorithm.oracle.progress_unit=chain
run oracle_state algorithm.adv_estimator=oracle algorithm.igpo.norm_mode=state_grouped
run igpo_uncentred algorithm.igpo.norm_mode=uncentred algorithm.igpo.turn_std=true algorithm.igpo.ig_weight=0.25
run igpo_state algorithm.igpo.norm_mode=state_grouped algorithm.igpo.ig_weight=0.1
