#!/usr/bin/env bash
# Issue #17's GPU measurements (docs/benchmarks.md, top), one after the other on one
# GPU node with the builtin + verl wheel sets installed (docs/offline-gpu.md). Each step runs under
# its own time limit and writes its log to RESULTS/<step>.log; RESULTS/chain.log has start, end,
# exit code and seconds of each. Start it detached so it outlives the shell that started it:
#     setsid bash bench/gpu_pending.sh /tmp/res <tiny tokenizer dir> > /tmp/res-chain.log 2>&1 &
# Then poll RESULTS/DONE. CORE_DONE marks the end of item 1 (the engines), the rest follows.
set -u
R=${1:?results dir}; TOK=${2:?tokenizer dir (the tiny default build: model.path of tiny-shop-grpo)}
Q05=${Q05:-/tmp/q05}
mkdir -p "$R"
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $(date +%T) start $name" >> "$R/chain.log"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "=== $(date +%T) end $name rc=$? $((SECONDS - t0)) s" >> "$R/chain.log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$R/chain.log"
step model 120 python3 -c "import sys, torch; from pathlib import Path; from bench.trainer_fits import qwen05b_dir; \
qwen05b_dir(Path(sys.argv[1]), Path(sys.argv[2]), torch.device('cuda'))" "$Q05" "$TOK"
# 1. verl over builtin on the same rows (0.5B), fastest of 3 passes each, eager and then with both
#    engines' decoder layers compiled (run.compile, as the builtin GPU recipes run)
step engines 420 python3 -m bench.engines --make-qwen05b "$Q05" --tokenizer "$TOK" --device cuda \
  --arms peak,hf,update,verl --episodes 64 --turns 15 --update-rows 320 --json "$R/engines.json" \
  --repeats 3 --no-full-logits algo.micro_batch_tokens=null
step engines_compiled 420 python3 -m bench.engines --model "$Q05" --device cuda \
  --arms hf,update,verl --episodes 64 --turns 15 --update-rows 320 --json "$R/engines_compiled.json" \
  --repeats 3 --no-full-logits algo.micro_batch_tokens=null run.compile=true
touch "$R/CORE_DONE"
# 2. the round's overhead on the 0.5B model (a CUDA lane reads each global into pinned buffers it reuses)
step round 900 flwr run . --run-config "recipe=\"smollm-shop-grpo\" rounds=3 local-epochs=1 run-dir=\"$R/q05-run\" model.path=\"$Q05\" model.warm_start.episodes=0" \
  --federation-config "num-supernodes=2 client-resources-num-cpus=4 client-resources-num-gpus=0.5" --stream
step round_overhead 60 python3 -m bench.round_overhead "$R/q05-run" --json "$R/round_overhead.json"
step superlink_stop 60 python3 -m server_app.local_superlink stop
# 3. the verl engine's contract on CUDA
step contract 480 python3 -m pytest -m gpu tests/test_engine_contract.py tests/test_lane_overhead.py \
  -p no:cacheprovider -q -rA --timeout 300 -k "verl-cuda and not 20_fits or pinned"
touch "$R/DONE"
