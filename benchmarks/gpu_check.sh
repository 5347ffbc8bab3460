#!/usr/bin/env bash
# GPU check: the embedded engine and the trainer on CUDA, the Ray backend with a GPU engine and trainer actor,
# and vLLM 0.32 from .venv-vllm (`vllm serve` started by agentrl, weights by disk reload and by vLLM's
# NCCL engine, an external server on both eval paths).  Each check runs on its own; the script prints one line per
# check (ok / FAILED / skipped, with the reason) and a JSON line last.  Exit 1 if any ran and failed.
#
#   bash benchmarks/gpu_check.sh            (from the repository root, in the project's venv)
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   GPU_CHECK_LOG=/path/log bash benchmarks/gpu_check.sh   (every check's whole output appended there as it ends)
#
# Budget: a few minutes on one GPU (tiny models).
set -u
PY=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG="$WORK/log"
declare -A RESULT
if [ -n "${GPU_CHECK_TIMEOUT:-}" ] && ! [[ "$GPU_CHECK_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_check: GPU_CHECK_TIMEOUT must be a whole number of seconds >= 1, got '$GPU_CHECK_TIMEOUT'" >&2; exit 2
fi

check() {  # check NAME TIMEOUT_S COMMAND...  (GPU_CHECK_TIMEOUT=S caps every check's limit)
  local name=$1 limit=$2 rc=0; shift 2
  [ -n "${GPU_CHECK_TIMEOUT:-}" ] && [ "$GPU_CHECK_TIMEOUT" -lt "$limit" ] && limit=$GPU_CHECK_TIMEOUT
  echo "== $name" >>"$LOG"
  timeout "$limit" "$@" >"$WORK/$name.out" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    RESULT[$name]=ok; echo "ok       $name"
  else  # 124: stopped at its time limit
    RESULT[$name]=failed; echo "FAILED   $name (exit $rc): $(tail -n 3 "$WORK/$name.out" | tr '\n' ' ' | cut -c1-300)"
  fi
  if [ -n "${GPU_CHECK_LOG:-}" ]; then { echo "== $name: ${RESULT[$name]} (exit $rc)"; cat "$WORK/$name.out"; } >>"$GPU_CHECK_LOG"; fi
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
# a random model earns no reward on calc: every group is kept (zero advantage) so the run neither stalls
# nor needs a warm start; the checks are about devices, pushes and versions, not learning
RUN+=(--buffer.filter_zero_variance=false)
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

# 5) vLLM 0.32 from .venv-vllm (`bash .ci/install-vllm` makes the CUDA build where nvidia-smi works;
#    INSTALL_VLLM=1 runs it here, ~5 min).  A warm-started model (SFT on calc) so RL has a signal.
[ "${INSTALL_VLLM:-0}" = 1 ] && bash .ci/install-vllm >"$WORK/install-vllm.out" 2>&1
VPY=.venv-vllm/bin/python
if [ -x .venv-vllm/bin/vllm ]; then
  WARM=(--sft.enabled=true --sft.steps=200 --sft.target_reward=0.3 --sft.eval_every=10 --sft.eval_tasks=50)
  VRUN=("${RUN[@]/--inference.device=cuda/--inference.max_model_len=512}" "${WARM[@]}" --inference.engine=vllm --trainer.steps=3 --eval.every=3
        --eval.num_tasks=20)
  # the step-0 mismatch KL must be ~0 (the trainer's dtype is served) and vLLM's weight version must
  # follow every push (engine/0/version = the step's version)
  cat >"$WORK/first_kl.py" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl") if "train/mismatch_kl" in line]
versions = [r.get("engine/0/version") for r in rows]
print("step-0 mismatch KL", rows[0]["train/mismatch_kl"], "versions", versions)
sys.exit(0 if len(rows) == 3 and abs(rows[0]["train/mismatch_kl"]) < 1e-3 and versions == [1, 2, 3] else 1)
PYEOF
  # a) agentrl starts `vllm serve` itself; weights by disk reload (the trainer's venv has no vLLM)
  check vllm_launch_disk 900 bash -c "$PY -m agentrl.cli run ${VRUN[*]} --run.dir=$WORK/vllm_disk \
    --inference.vllm_weight_transfer=disk && $PY $WORK/first_kl.py $WORK/vllm_disk"
  # b) the same with vLLM 0.32's NCCL engine (NCCLTrainerWeightTransferEngine): the trainer runs in
  #    .venv-vllm, with agentrl installed there
  if $VPY -m pip install -q -e . >"$WORK/pip-agentrl.out" 2>&1; then
    check vllm_launch_nccl 900 bash -c "$VPY -m agentrl.cli run ${VRUN[*]} --run.dir=$WORK/vllm_nccl \
      --inference.vllm_weight_transfer=nccl && $PY $WORK/first_kl.py $WORK/vllm_nccl"
  else
    skip vllm_launch_nccl "cannot install agentrl into .venv-vllm: $(tail -n 1 "$WORK/pip-agentrl.out")"
  fi
  # c) an external `vllm serve` (dev-mode routes on, its own key): eval on both paths, then a run
  #    given its base_url as one string: the warm start is pushed into it first
  PORT=8977 KEY=gpu-check-key
  VLLM_SERVER_DEV_MODE=1 VLLM_HOST_IP=127.0.0.1 .venv-vllm/bin/vllm serve "$WORK/tiny" --host 127.0.0.1 \
    --port $PORT --api-key $KEY --dtype float32 --logprobs-mode processed_logprobs --generation-config vllm \
    --kv-cache-memory-bytes 2147483648 --enforce-eager --enable-auto-tool-choice --tool-call-parser hermes \
    >"$WORK/vllm.out" 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 1 150); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 2; done
  for path in token chat; do
    check "vllm_eval_$path" 300 $PY -m agentrl.cli eval calc --model "$WORK/tiny" --base-url "http://127.0.0.1:$PORT/v1" \
      --api-key $KEY --tokenizer "$WORK/tiny" -n 4 -r 2 --max-tokens 24 --out "$WORK/vllm_eval_$path" \
      $([ $path = chat ] && echo --chat)
  done
  check vllm_external 600 bash -c "AGENTRL_API_KEY=$KEY $PY -m agentrl.cli run ${VRUN[*]} --run.dir=$WORK/vllm_ext \
    --inference.base_url=http://127.0.0.1:$PORT/v1 --inference.model_name=$WORK/tiny \
    --inference.vllm_weight_transfer=disk && $PY $WORK/first_kl.py $WORK/vllm_ext"
  kill "$VLLM_PID" 2>/dev/null; wait "$VLLM_PID" 2>/dev/null
else
  for k in vllm_launch_disk vllm_launch_nccl vllm_eval_token vllm_eval_chat vllm_external; do
    skip "$k" "no .venv-vllm: bash .ci/install-vllm (or INSTALL_VLLM=1)"
  done
fi

# ---------------------------------------------------------------------------------------------------------------
# 6) the sharded trainer (trainer.world_size = 2: FSDP2 on nccl, one GPU per rank; agentrl/trainer/sharded.py).
#    Its own block: it needs 2 GPUs, the checks above need one.
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  check fsdp2_parity 600 $PY benchmarks/trainer_parity.py --world-size 2 --losses icepop,gspo --device cuda
  check fsdp2_rl 600 bash -c "$PY -m agentrl.cli run ${RUN[*]} --run.dir=$WORK/fsdp2_rl --trainer.world_size=2 \
    && test \$(wc -l < $WORK/fsdp2_rl/metrics.jsonl) -eq 3"
  # the same 2 ranks placed by Ray (cluster.trainer_actor: one rank actor per GPU, STRICT_PACK, nccl), the engine
  # actor on the CPU (both GPUs are the ranks'); a checkpoint at step 2 goes through the rank actors' shard files
  check fsdp2_ray 600 bash -c "$PY -m agentrl.cli run ${RUN[*]/--inference.device=cuda/--inference.device=cpu} \
    --run.dir=$WORK/fsdp2_ray --trainer.world_size=2 --trainer.checkpoint_every=2 --cluster.backend=ray \
    --cluster.num_inference=1 --cluster.trainer_actor=true --cluster.trainer_gpus=1 --inference.weight_transport=http \
    && test \$(wc -l < $WORK/fsdp2_ray/metrics.jsonl) -eq 3 && ls $WORK/fsdp2_ray/checkpoints/step_00000002/trainer/__1_0.distcp"
else
  for k in fsdp2_parity fsdp2_rl fsdp2_ray; do skip "$k" "needs 2 GPUs (trainer.world_size = 2 on nccl)"; done
fi
# ---------------------------------------------------------------------------------------------------------------

failed=0; json="{\"benchmark\": \"gpu_check\", \"cuda\": true"
for k in "${!RESULT[@]}"; do json+=", \"$k\": \"${RESULT[$k]}\""; [ "${RESULT[$k]}" = failed ] && failed=1; done
echo "$json}"
exit $failed
