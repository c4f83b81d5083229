#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md's engines section, one after the other on one GPU
# node with the builtin + verl wheel sets installed (docs/offline-gpu.md). Each step runs under its
# own time limit and writes its log to RESULTS/<step>.log; RESULTS/chain.log has start, end, exit
# code and seconds of each. Start it detached so it outlives the shell that started it:
#     setsid bash bench/gpu_pending.sh /tmp/res <tiny tokenizer dir> > /tmp/res-chain.log 2>&1 &
# Then poll RESULTS/DONE.
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
step model 120 python3 -c "import sys, torch; from pathlib import Path; from bench.trainer_fits import random_qwen_dir; \
random_qwen_dir(Path(sys.argv[1]), Path(sys.argv[2]), torch.device('cuda'))" "$Q05" "$TOK"
# 1. verl over builtin on the same rows (0.5B), fastest of 3 passes each (x1.28 on one H100,
#    2026-12-06; run it on the code before a change too, from a `git archive`, to compare)
step engines 420 python3 -m bench.engines --model "$Q05" --device cuda --arms update,hf,verl \
  --episodes 64 --turns 15 --update-rows 320 --json "$R/engines.json" --repeats 3 --no-full-logits \
  algo.micro_batch_tokens=null
# 2. verl's engine contract on CUDA (16 tests; all passed on one H100, 2026-12-06)
step contract 420 python3 -m pytest -m gpu tests/trainer/test_engine_contract.py tests/trainer/test_verl_cuda.py \
  -k "verl-cuda and not 20_fits or test_verl_cuda" -p no:cacheprovider -q -rA --timeout 300
# 3. where verl's pass still loses: the synchronisations by origin, then kernels and host time
step profile 300 python3 -m bench.update_profile --model "$Q05" --device cuda --mini 16 --rows 320 \
  --prompt-tokens 120 260 --reply-tokens 5 36 --precision bf16 verl:auto --repeats 2 --syncs --profile --top 30
touch "$R/DONE"
