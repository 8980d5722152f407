#!/usr/bin/env bash
# The `compact` recipe (README.md, "The default models") as one background pipeline on a GPU host reached through
# short calls (each at most 10 minutes, files back at most 16 MiB each and 64 MiB a call): the target, then its MoA
# (TLI N) and EAGLE drafters at once, then the weights packed (tar + xz) into parts that come back in one call.
#
# The step counts come from the host's own speed, so that the target trains for about TARGET_S seconds and the
# drafters for about DRAFT_S: a short probe run of each measures its steps per second first (the probes' weights
# are thrown away; their figures are in the log). TARGET_STEPS / DRAFTER_STEPS, when set, skip the probes.
#
# On the GPU host, from the root of a clean export of the repository (so that nothing uncommitted trains), with
# the corpus carried xz-compressed in $CORPUS (laid out as README.md's 86M step 1) and, if the host lacks packages,
# their wheels in .whl:
#   bash deploy/models/compact/pipeline.sh start    # installs, unpacks and checks the corpus, starts; then polls
#   bash deploy/models/compact/pipeline.sh poll     # waits up to POLL_S s (from the call's start) for DONE;
#                                                   # once packed, also ships parts 1-4 as `ship 1` does
#   bash deploy/models/compact/pipeline.sh ship 2   # parts 5-8, if there are more than four
# Back here:
#   bash deploy/models/compact/pipeline.sh join DIR...   # the DIRs' parts -> runs/compact/{target,drafter,...}
# A CPU dry run, everything shrunk:
#   WORK=/tmp/dry PY=$PWD/.venv/bin/python DEVICE=cpu CORPUS=.corpus-compact TARGET_STEPS=2 BATCH=2 SEQ=64 \
#     DRAFTER_STEPS=2 DRAFT_BATCH=2 EVAL_WINDOWS=2 bash deploy/models/compact/pipeline.sh start
set -u
WORK=${WORK:-/tmp/tether-compact}
SCRIPT=$(realpath "$0")
export PY=${PY:-python3} DEVICE=${DEVICE:-cuda} PRESET=${PRESET:-compact} TARGET_S=${TARGET_S:-540} \
  DRAFT_S=${DRAFT_S:-240} BATCH=${BATCH:-64} SEQ=${SEQ:-1024} LR=${LR:-2e-3} WARMUP=${WARMUP:-200} \
  EVAL_WINDOWS=${EVAL_WINDOWS:-256} DRAFT_BATCH=${DRAFT_BATCH:-48} TLI=${TLI:-3} \
  TARGET_STEPS=${TARGET_STEPS:-} DRAFTER_STEPS=${DRAFTER_STEPS:-}
CORPUS=$(realpath "${CORPUS:-.corpus-compact}")
FILES_TARGET="config.json model.safetensors tokenizer.json summary.json history.json loss.png"
FILES_DRAFTER="drafter_config.json drafter.safetensors summary.json history.json loss.png"

# shellcheck source=SCRIPTDIR/../pipeline_parts.sh
source "$(dirname "$SCRIPT")/../pipeline_parts.sh"

case "${1:-}" in
stage)  # a call ahead of `start` carrying part of $CORPUS (README.md, the 86M's step 1: when too large for one call)
  set -e
  stage_host "$CORPUS"
  ;;
start)
  set -e
  prepare_host "$CORPUS" "$WORK/data/corpus"
  launch <<'EOF'
json() { "$PY" -c "import json, sys; print(eval(sys.argv[2], {'json': json, 'j': json.load(open(sys.argv[1]))}))" "$@"; }
T="$PY -m tether.server.cli train-target --preset $PRESET --data data/corpus --device $DEVICE --batch-size $BATCH"
T="$T --seq-len $SEQ --quiet"
drafters() {  # $1: steps, $2: output folder, then extra flags for both
  local steps=$1 dir=$2 n F
  shift 2
  mkdir -p "$dir"
  for n in moa eagle; do
    if [ $n = eagle ]; then F="--kind eagle"; else F="--kind moa --tli $TLI"; fi
    # shellcheck disable=SC2086  # F holds two or three flags
    OMP_NUM_THREADS=2 "$PY" -m tether.server.cli train-drafter --target runs/target --data data/corpus \
      --device "$DEVICE" --out "$dir/$n" --steps "$steps" --batch-size "$DRAFT_BATCH" --seq-len 256 --quiet $F "$@" \
      > "$dir-$n.log" 2>&1 &
  done
  wait
  for n in moa eagle; do [ -f "$dir/$n/drafter_config.json" ] || fail "drafter $n" "$dir-$n.log"; done
}
if [ -z "$TARGET_STEPS" ]; then
  stamp target-probe
  # 60 steps; the speed of each 10 is recorded: the last one is past compilation and warm-up
  $T --out probe/target --steps 60 --warmup 10 --eval-every 1000 --eval-windows 2 --save-every 1000 \
    > probe-target.log 2>&1 || fail "target probe" probe-target.log
  rate=$(json probe/target/history.json "j['speed'][-1][1]")
  TARGET_STEPS=$(json probe/target/history.json "max(100, int($TARGET_S * $rate / ($BATCH * $SEQ)) // 100 * 100)")
  echo "PROBE target $rate tokens/s -> $TARGET_STEPS steps"
fi
stamp target
E=$(( TARGET_STEPS / 8 > 0 ? TARGET_STEPS / 8 : 1 ))
W=$(( WARMUP < TARGET_STEPS / 10 ? WARMUP : TARGET_STEPS / 10 ))
$T --out runs/target --steps "$TARGET_STEPS" --lr "$LR" --warmup "$W" --eval-every "$E" \
  --eval-windows "$EVAL_WINDOWS" --save-every "$TARGET_STEPS" --time-limit-s $(( TARGET_S * 3 / 2 )) \
  > target.log 2>&1 || fail target target.log
if [ -z "$DRAFTER_STEPS" ]; then
  stamp drafter-probe
  # 100 steps each, both at once as in the real run; their wall time includes one cheap evaluation
  drafters 100 probe/drafters --eval-every 1000 --eval-windows 2 --eval-prompts 1 --eval-new-tokens 8 \
    --save-every 1000
  DRAFTER_STEPS=$(json probe/drafters/moa/summary.json \
    "max(100, int($DRAFT_S * 100 / max(j['wall_s'], json.load(open('probe/drafters/eagle/summary.json'))['wall_s']))
       // 100 * 100)")
  echo "PROBE drafters $(json probe/drafters/moa/summary.json "j['wall_s']") s (moa), \
$(json probe/drafters/eagle/summary.json "j['wall_s']") s (eagle) for 100 steps -> $DRAFTER_STEPS steps"
fi
stamp drafters
E=$(( DRAFTER_STEPS / 4 > 0 ? DRAFTER_STEPS / 4 : 1 ))
drafters "$DRAFTER_STEPS" runs/drafters --eval-every "$E" --save-every "$DRAFTER_STEPS" \
  --time-limit-s $(( DRAFT_S * 3 / 2 ))
EOF
  ;&  # and poll in the same call
poll)
  wait_for_done probe-target.log target.log probe/drafters-moa.log runs/drafters-moa.log runs/drafters-eagle.log
  ;;
pack)  # in $WORK, once both drafters are trained: the weights -> weights.tar.xz in parts, and its checksum
  files=(log target.log runs/drafters-moa.log runs/drafters-eagle.log)
  for f in $FILES_TARGET; do files+=("runs/target/$f"); done
  for n in moa eagle; do for f in $FILES_DRAFTER; do files+=("runs/drafters/$n/$f"); done; done
  pack_parts "${files[@]}" || exit 1
  ;;
ship)
  ship_parts "${2:?ship N}"
  ;;
join)
  shift
  join_parts runs/compact 0 "$@"
  ;;
*)
  echo "usage: $0 stage | start | poll | pack | ship N | join DIR..." >&2
  exit 2
  ;;
esac
