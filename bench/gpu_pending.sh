#!/usr/bin/env bash
# Issue #17's GPU measurements (docs/benchmarks.md, top), one after the other on one
# GPU node with the builtin + verl wheel sets installed (docs/offline-gpu.md). Each step runs under
# its own time limit and writes its log to RESULTS/<step>.log; RESULTS/chain.log has start, end,
# exit code and seconds of each. Start it detached so it outlives the shell that started it:
#     setsid bash bench/gpu_pending.sh /tmp/res <tiny tokenizer dir> > /tmp/res-chain.log 2>&1 &
# Then poll RESULTS/DONE. CORE_DONE marks the end of the overhead items (2, 3), the rest follows.
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
# 2. verl over builtin on the same rows (0.5B); as recorded before the token budget
step engines 480 python3 -m bench.engines --make-qwen05b "$Q05" --tokenizer "$TOK" --device cuda \
  --arms peak,hf,update,verl --episodes 64 --turns 15 --update-rows 320 --json "$R/engines.json" \
  algo.micro_batch_tokens=null
# 3. shard IO next to raw IO, then the round's overhead on the 0.5B model
step weights_io 240 python3 bench/weights_io.py --size-gb 1.9 --device cuda --repeat 2
step round 600 flwr run . --run-config "recipe=\"smollm-shop-grpo\" rounds=3 local-epochs=1 run-dir=\"$R/q05-run\" model.path=\"$Q05\" model.warm_start.episodes=0" \
  --federation-config "num-supernodes=2 client-resources-num-cpus=4 client-resources-num-gpus=0.5" --stream
step round_overhead 60 python3 -m bench.round_overhead "$R/q05-run" --json "$R/round_overhead.json"
step superlink_stop 60 python3 -m server_app.local_superlink stop
touch "$R/CORE_DONE"
# 1. the verl engine's contract on CUDA and the byte comparison of shards from CUDA masters
step contract 480 python3 -m pytest -m gpu tests/test_engine_contract.py -p no:cacheprovider -q -rA --timeout 300 \
  -k "(verl-cuda or master_weights) and not 20_fits"
# 4. the token budget on a GPU (0.5B, the shop expert's rows, 64-row mini-batches)
step token_budget 300 python3 -m bench.update_profile --model "$Q05" --recipe smollm-shop-grpo --device cuda \
  --rows 320 --mini 64 --rows-from demos --precision bf16+compile bf16+compile@8192 bf16+compile@16384 --repeats 2
step contract_20_fits 400 python3 -m pytest -m gpu tests/test_engine_contract.py -p no:cacheprovider -q -rA \
  --timeout 300 -k "verl-cuda and 20_fits"
touch "$R/DONE"
