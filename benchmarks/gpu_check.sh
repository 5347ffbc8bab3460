#!/usr/bin/env bash
# GPU check: the embedded engine and the trainer on CUDA, the Ray backend with a GPU engine and trainer actor,
# and vLLM when it is installed.  Each check runs on its own; the script prints one line per
# check (ok / FAILED / skipped, with the reason) and a JSON line last.  Exit 1 if any ran and failed.
#
#   bash benchmarks/gpu_check.sh            (from the repository root, in the project's venv)
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Budget: a few minutes on one GPU (tiny models).
set -u
PY=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG="$WORK/log"
declare -A RESULT

check() {  # check NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name" >>"$LOG"
  if timeout "$limit" "$@" >"$WORK/$name.out" 2>&1; then
    RESULT[$name]=ok; echo "ok       $name"
  else
    RESULT[$name]=failed; echo "FAILED   $name (exit $?): $(tail -n 3 "$WORK/$name.out" | tr '\n' ' ' | cut -c1-300)"
  fi
}

skip() { RESULT[$1]="skipped"; echo "skipped  $1: $2"; }

# 0) the device
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to torch: nothing to check"; echo '{"benchmark": "gpu_check", "cuda": false}'; exit 1
fi
$PY -c "import torch; print('cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
$PY -c "from agentrl.tiny_model import build_tiny_model; build_tiny_model('$WORK/tiny', layers=2, hidden=64, heads=4)" \
  || { echo "cannot build the tiny model"; exit 1; }

# 1) the embedded engine on CUDA: greedy completions with logprobs and versions
check engine_cuda 300 $PY benchmarks/engine_throughput.py --model-dir "$WORK/tiny" --device cuda --requests 32 --max-tokens 64

# 2) engine + trainer on CUDA: a short RL run, weights pushed over shm
RUN=(--model.path="$WORK/tiny" --sft.enabled=false --env.name=calc --trainer.steps=3 --rollout.group_size=4
     --rollout.max_in_flight=16 --rollout.max_tokens=24 --rollout.max_turns=2 --trainer.batch_groups=2
     --eval.every=0 --trainer.checkpoint_every=0 --inference.device=cuda --trainer.device=cuda)
check rl_cuda 600 bash -c "$PY -m agentrl.cli run ${RUN[*]} --run.dir=$WORK/rl_cuda && test \$(wc -l < $WORK/rl_cuda/metrics.jsonl) -eq 3"

# 3) the same run on the Ray backend, 1 GPU engine actor and the trainer as a GPU actor (half a
#    GPU each), weights over HTTP chunks pushed from the trainer actor
check ray_cuda 600 bash -c "$PY -m agentrl.cli run ${RUN[*]} --run.dir=$WORK/ray_cuda --cluster.backend=ray \
  --cluster.num_inference=1 --cluster.engine_gpus=0.5 --cluster.trainer_actor=true --cluster.trainer_gpus=0.5 \
  --inference.weight_transport=http && test \$(wc -l < $WORK/ray_cuda/metrics.jsonl) -eq 3"

# 4) engine and trainer agree on CUDA: at step 0 the sampler's and the trainer's weights are equal,
#    so the mismatch KL between μ (engine logprobs) and π_θ (trainer logprobs) must be ~0
check cuda_logprob_parity 60 $PY -c "
import json, sys
row = json.loads(open('$WORK/rl_cuda/metrics.jsonl').readline())
kl = row.get('train/mismatch_kl')
print('step-0 mismatch KL', kl)
sys.exit(0 if kl is not None and abs(kl) < 1e-3 else 1)"

# 5) vLLM, when installed: serve the tiny model and run the same short RL run against it
if $PY -c "import vllm" 2>/dev/null; then
  PORT=8977
  $PY -m vllm.entrypoints.openai.api_server --model "$WORK/tiny" --port $PORT --gpu-memory-utilization 0.3 \
    --enforce-eager >"$WORK/vllm.out" 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 2; done
  check vllm_eval 300 $PY -m agentrl.cli eval calc --model "$WORK/tiny" --base-url "http://127.0.0.1:$PORT/v1" \
    -n 4 -r 2 --max-tokens 24 --out "$WORK/vllm_eval"
  check vllm_rl 600 bash -c "$PY -m agentrl.cli run ${RUN[*]} --run.dir=$WORK/vllm_rl --inference.engine=vllm \
    --inference.base_url=http://127.0.0.1:$PORT/v1 && test \$(wc -l < $WORK/vllm_rl/metrics.jsonl) -eq 3"
  kill "$VLLM_PID" 2>/dev/null; wait "$VLLM_PID" 2>/dev/null
else
  skip vllm_eval "vllm is not installed"; skip vllm_rl "vllm is not installed"
fi

failed=0; json="{\"benchmark\": \"gpu_check\", \"cuda\": true"
for k in "${!RESULT[@]}"; do json+=", \"$k\": \"${RESULT[$k]}\""; [ "${RESULT[$k]}" = failed ] && failed=1; done
echo "$json}"
exit $failed
