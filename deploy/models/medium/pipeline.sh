#!/usr/bin/env bash
# The 86M recipe of README.md (step 3 of "The 86M target") as one background pipeline on a GPU host that is
# reached through short calls (each call at most 10 minutes, files back at most 16 MiB each and 64 MiB a call): the
# `medium` target (1,000 steps), then the moa4 and eagle drafters at once (1,200 steps each), then the weights packed
# (tar + xz) and split into parts that `ship` hands back four at a time. The tree-shape measurement then runs
# wherever the weights land (bench/spec.py on a CPU: the GPU host's time is the scarce part).
#
# On the GPU host, from the repository root, with the corpus carried xz-compressed in .corpus (README.md, its step 1)
# and, if the host lacks packages, their wheels in .whl:
#   bash deploy/models/medium/pipeline.sh stage    # (only when .corpus is too large for one call: README.md) installs,
#                                                  # adds this call's part of .corpus to the staged corpus
#   bash deploy/models/medium/pipeline.sh start    # installs, unpacks and checks the corpus, starts; then polls
#   bash deploy/models/medium/pipeline.sh poll     # waits up to POLL_S s (from the call's start) for DONE;
#                                                  # once packed, also ships parts 1-4 as `ship 1` does
#   (the pipeline runs `pack` itself once both drafters are trained)
#   bash deploy/models/medium/pipeline.sh ship 1   # parts 1-4 and the checksum into $OUT; `ship 2`: parts 5-8 ...
# Back on the machine that measures:
#   bash deploy/models/medium/pipeline.sh join DIR...   # the DIRs' parts -> runs/86m/{medium,drafters/moa4,...}
# Every call prints the stage log (STAGE name epoch-seconds UTC) and the end of each training log. The pipeline
# runs in its own session (setsid), so it outlives the call that started it.
set -u
WORK=${WORK:-/tmp/tether-pipeline}
SCRIPT=$(realpath "$0")
# The recipe's figures; a dry run elsewhere shrinks them (DEVICE=cpu PRESET=small TARGET_STEPS=2 ...).
# DRAFTERS="moa4" trains (and packs) the MoA drafter alone, when the lease is too short for both.
export PY=${PY:-python3} DEVICE=${DEVICE:-cuda} PRESET=${PRESET:-medium} TARGET_STEPS=${TARGET_STEPS:-1000} \
  BATCH=${BATCH:-64} DRAFTER_STEPS=${DRAFTER_STEPS:-1200} DRAFT_BATCH=${DRAFT_BATCH:-48} \
  DRAFTERS=${DRAFTERS:-moa4 eagle}
REPO=$(pwd)

# shellcheck source=SCRIPTDIR/../pipeline_parts.sh
source "$(dirname "$SCRIPT")/../pipeline_parts.sh"

case "${1:-}" in
stage)  # a call ahead of `start` carrying part of .corpus (README.md, its step 1: when it is too large for one call)
  set -e
  stage_host "$REPO/.corpus"
  ;;
start)
  set -e
  prepare_host "$REPO/.corpus" "$WORK/data/corpus-pkgs"
  launch <<'EOF'
stamp target
"$PY" -m tether.server.cli train-target --preset "$PRESET" --data data/corpus-pkgs \
  --out runs/medium --device "$DEVICE" --steps "$TARGET_STEPS" --batch-size "$BATCH" --seq-len 1024 --lr 1e-3 \
  --warmup 100 --eval-every 200 --eval-windows 256 --save-every 500 > target.log 2>&1 || fail target target.log
stamp drafters
for n in $DRAFTERS; do
  if [ $n = eagle ]; then F="--kind eagle"; else F="--kind moa --tli 4"; fi
  OMP_NUM_THREADS=2 "$PY" -m tether.server.cli train-drafter --target runs/medium --data data/corpus-pkgs \
    --device "$DEVICE" --out runs/drafters/$n --steps "$DRAFTER_STEPS" --batch-size "$DRAFT_BATCH" --seq-len 256 \
    --eval-every 400 --save-every 600 $F > drafter-$n.log 2>&1 &
done
wait
for n in $DRAFTERS; do [ -f runs/drafters/$n/drafter_config.json ] || fail "drafter $n" drafter-$n.log; done
EOF
  ;&  # and poll in the same call
poll)
  wait_for_done target.log drafter-moa4.log drafter-eagle.log
  ;;
pack)  # in $WORK, once both drafters are trained: the weights -> weights.tar.xz in parts, and its checksum
  M=runs/medium
  files=("$M/config.json" "$M/model.safetensors" "$M/tokenizer.json" "$M/summary.json" "$M/history.json")
  for n in $DRAFTERS; do
    for f in drafter_config.json drafter.safetensors summary.json history.json; do files+=("runs/drafters/$n/$f"); done
  done
  pack_parts "${files[@]}" || exit 1
  ;;
ship)
  ship_parts "${2:?ship N}"
  ;;
join)
  shift
  join_parts runs/86m 1 "$@"
  ;;
*)
  echo "usage: $0 stage | start | poll | pack | ship N | join DIR..." >&2
  exit 2
  ;;
esac
