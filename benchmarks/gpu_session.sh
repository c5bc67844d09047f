#!/usr/bin/env bash
# Everything issue 6 still needs from a GPU, in parts that each fit one 10-minute device command:
#
#   bash benchmarks/gpu_session.sh env      # GPU, driver, torch; the matmul peak
#   bash benchmarks/gpu_session.sh tests    # the fast-path equality tests on CUDA (test_fastpath runs them on
#                                           # cpu and cuda), optimizer and HF-parity tests
#   bash benchmarks/gpu_session.sh p1       # BERT-Large phase 1 (seq 128, batch 64), bf16, LAMB, vs HF SDPA+compile
#   bash benchmarks/gpu_session.sh p2       # BERT-Large phase 2 (seq 512, batch 16)
#   bash benchmarks/gpu_session.sh jagged   # phases 1 and 2 with attention on nested (jagged) tensors
#   bash benchmarks/gpu_session.sh squad    # SQuAD inference at seq 384, batch 64
#   bash benchmarks/gpu_session.sh ttq      # issue 22: pretraining time to quality vs HF Trainer, 90 s budgets
#   bash benchmarks/gpu_session.sh ttq-ft   # issue 22: SST-2 fine-tuning time to quality vs HF Trainer, 60 s budgets
#
# The ttq parts need `accelerate` (HF Trainer refuses to start without it), which the GPU image may lack: bring
# its wheel with the device README's .whl recipe.
# Runs from the repository root with PYTHONPATH=src (the GPU image has torch, transformers, tokenizers,
# safetensors, PyYAML; nothing is installed). Full outputs go to $OUT (default gpu-results/); the last lines
# printed are a short summary. Numbers go to BENCHMARKS.md, "Training and inference speed: GPU".
set -u
part=${1:-env}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

bench() {  # name, then bertrain bench arguments
    local name=$1; shift
    timeout 540 "$PY" -m bertrain bench "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.log"
    local rc=$?
    "$PY" - "$OUT/$name.json" "$name" "$rc" <<'EOF'
import json, sys
path, name, rc = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception as e:  # noqa: BLE001 - a summary line whatever happened
    print(f"{name}: rc={rc}, no JSON ({e}); see {path[:-5]}.log"); sys.exit()
mode = r.get("mode", "pretrain")
res = r.get(mode, {})
ours, hf = res.get("bertrain", {}), res.get("hf") or {}
fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"
print(f"{name} ({mode}): ours {fmt(ours.get('seq_per_s'), '.0f')} seq/s, {fmt(ours.get('tflops'), '.0f')} TFLOP/s, "
      f"MFU {fmt(ours.get('mfu'), '.1%')}, peak {fmt(ours.get('peak_mem_mb'), '.0f')} MB; "
      f"HF {fmt(hf.get('seq_per_s'), '.0f')} seq/s; ours/HF {fmt(r.get('speedup'), '.2f')}")
EOF
}

case "$part" in
env)
    nvidia-smi | tee "$OUT/nvidia-smi.txt" | head -15
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'transformers', transformers.__version__)" | tee "$OUT/env.txt"
    ;;
tests)
    "$PY" -m pytest -q -p no:cacheprovider tests/test_fastpath.py tests/test_train_optim.py tests/test_hf_parity.py \
        > "$OUT/tests.txt" 2>&1
    echo "tests rc=$?"; tail -5 "$OUT/tests.txt"
    ;;
p1)
    bench large-phase1 --model large --seq-len 128 --batch-size 64 --device cuda --precision bf16 --compare hf \
        --compile --optimizer lamb --steps 30
    ;;
p2)
    bench large-phase2 --model large --seq-len 512 --batch-size 16 --device cuda --precision bf16 --compare hf \
        --compile --optimizer lamb --steps 30
    ;;
jagged)
    bench large-phase1-jagged --model large --seq-len 128 --batch-size 64 --device cuda --precision bf16 \
        --jagged-attention --optimizer lamb --steps 30
    bench large-phase2-jagged --model large --seq-len 512 --batch-size 16 --device cuda --precision bf16 \
        --jagged-attention --optimizer lamb --steps 30
    ;;
squad)
    bench squad-inference --model large --mode inference --seq-len 384 --batch-size 64 --device cuda \
        --precision bf16 --compare hf --steps 30
    ;;
ttq)  # 4 runs x 90 s + data and scoring: within one 10-minute command
    timeout 570 "$PY" benchmarks/time_to_quality.py pretrain --out "$OUT/ttq-pretrain" --device cuda --budget 90s \
        --seeds 1 2 --save-every 200 > "$OUT/ttq-pretrain.log" 2>&1
    echo "ttq rc=$?"; tail -25 "$OUT/ttq-pretrain/summary.md" 2>/dev/null || tail -5 "$OUT/ttq-pretrain.log"
    ;;
ttq-ft)
    timeout 570 "$PY" benchmarks/ttq_finetune.py --out "$OUT/ttq-sst2" --device cuda --tasks sst2 --seeds 1 2 \
        --budget 60s --save-every 100 > "$OUT/ttq-sst2.log" 2>&1
    echo "ttq-ft rc=$?"; tail -25 "$OUT/ttq-sst2/summary.md" 2>/dev/null || tail -5 "$OUT/ttq-sst2.log"
    ;;
*)
    echo "unknown part $part: env | tests | p1 | p2 | jagged | squad | ttq | ttq-ft" >&2; exit 2
    ;;
esac
