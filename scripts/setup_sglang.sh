#!/usr/bin/env bash
# Create the separate virtualenv that runs real SGLang 0.5.23 for the `sglang` engine tests.
#
# Why a separate venv: SGLang pins its own torch (2.14.1) while the project's main venv uses
# torch 2.13 CPU. Why --no-deps: the full `pip install sglang` pulls ~1.2 GB of CUDA kernels
# that cannot run here; SGLang's plain-torch CPU path needs only the light runtime deps below
# (see docs/sglang.md). Idempotent: a stamp file recording the pinned set makes reruns instant.
#
# Usage: scripts/setup_sglang.sh            (venv at $SGLANG_VENV, default .venv-sglang in the repository root)
#        SGLANG_VENV=/some/dir scripts/setup_sglang.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${SGLANG_BASE_PYTHON:-python3.11}"
SGLANG_VERSION="0.5.23"

# torch/torchvision: a CUDA build is required even on CPU, because SGLang imports torchvision and
# the PyPI torchvision is a CUDA build (a CPU-only torch then fails to load its ops).
TORCH_PKGS=("torch==2.14.1" "torchvision==0.29.1" "triton==3.8.0")
LIGHT_DEPS=(
  aiohttp fastapi "uvicorn>=0.51" uvloop pyzmq orjson msgspec pydantic
  "transformers==5.19.0" "tokenizers==0.23.2" safetensors numpy psutil requests
  setproctitle pybase64 python-multipart packaging tqdm partial_json_parser pillow
  einops interegular prometheus-client "python-dateutil<3" regex xxhash zstandard
  watchfiles distro easydict IPython dill "apache-tvm-ffi==0.1.11"
  "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0"
  jsonschema "xgrammar==0.2.7" "soundfile==0.13.1"
)
STAMP="$VENV/.verl_agent_sglang_stamp"
WANT="sglang==$SGLANG_VERSION ${TORCH_PKGS[*]} ${LIGHT_DEPS[*]}"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
  echo "sglang venv ready: $VENV"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "${TORCH_PKGS[@]}"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" "${LIGHT_DEPS[@]}"
# Fail here, not in the tests, if the pinned set does not import together.
"$VENV/bin/python" -c "import sglang, sglang.srt.managers.io_struct, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$WANT" > "$STAMP"
echo "sglang venv built in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
