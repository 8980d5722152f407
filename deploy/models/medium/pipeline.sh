#!/usr/bin/env bash
# The 86M recipe of README.md section 8 as one background pipeline on a GPU host that is reached through short
# calls (each call at most 10 minutes, files back at most 16 MiB each and 64 MiB a call): the `medium` target
# (1,000 steps), then the moa4 and eagle drafters at once (1,200 steps each), then the weights packed
# (tar + xz) and split into parts that `ship` hands back four at a time. The tree-shape measurement then runs
# wherever the weights land (bench/spec.py on a CPU: the GPU host's time is the scarce part).
#
# On the GPU host, from the repository root, with the corpus carried xz-compressed in .corpus (README section 1)
# and, if the host lacks packages, their wheels in .whl:
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
POLL_S=${POLL_S:-540}
PART_BYTES=${PART_BYTES:-16700000}  # four of them and the checksum stay under 64 MiB, each under 16 MiB
SCRIPT=$(realpath "$0")
# The recipe's figures; a dry run elsewhere shrinks them (DEVICE=cpu PRESET=small TARGET_STEPS=2 ...).
export PY=${PY:-python3} DEVICE=${DEVICE:-cuda} PRESET=${PRESET:-medium} TARGET_STEPS=${TARGET_STEPS:-1000} \
  BATCH=${BATCH:-64} DRAFTER_STEPS=${DRAFTER_STEPS:-1200} DRAFT_BATCH=${DRAFT_BATCH:-48}
REPO=$(pwd)

ship() {  # parts 4N-3..4N and the checksum into $OUT
  local all parts
  mapfile -t all < <(cd "$WORK" && printf '%s\n' part-*)
  parts=("${all[@]:$(( ($1 - 1) * 4 )):4}")
  [ ${#parts[@]} -gt 0 ] && [ -f "$WORK/${parts[0]}" ] || { echo "no part $1"; exit 1; }
  for p in "${parts[@]}"; do cp "$WORK/$p" "$OUT/"; done
  cp "$WORK/weights.sha256" "$OUT/"
  echo "shipped ${parts[*]} of ${#all[@]}"
}

case "${1:-}" in
start)
  set -e
  mkdir -p "$WORK"
  if ! "$PY" -c 'import tether.server.cli, zstandard' 2>/dev/null; then
    if [ -d .whl ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-t . >/dev/null
  fi
  export PYTHONPATH=/tmp/site-t:/tmp/site
  "$PY" -c 'import tether.server.cli, zstandard'
  D=$WORK/data/corpus-pkgs
  mkdir -p "$D" && cp .corpus/tokenizer.json "$D"/
  for s in train val; do xz -dc -T0 .corpus/$s.bin.xz > "$D/$s.bin"; done
  cp .corpus/manifest.json "$D"/
  (cd "$D" && sha256sum -c --quiet "$REPO/.corpus/SHA256SUMS")
  echo "corpus checked"
  cat > "$WORK/pipeline.sh" <<'EOF'
export PYTHONPATH=/tmp/site-t:/tmp/site PYTHONUNBUFFERED=1
stamp() { echo "STAGE $1 $(date +%s) $(date -u +%T)"; }
fail() { echo "FAIL $1"; tail -30 "$2"; echo DONE; exit 1; }
stamp target
"$PY" -m tether.server.cli train-target --preset "$PRESET" --data data/corpus-pkgs \
  --out runs/medium --device "$DEVICE" --steps "$TARGET_STEPS" --batch-size "$BATCH" --seq-len 1024 --lr 1e-3 \
  --warmup 100 --eval-every 200 --eval-windows 256 --save-every 500 > target.log 2>&1 || fail target target.log
stamp drafters
for n in moa4 eagle; do
  if [ $n = eagle ]; then F="--kind eagle"; else F="--kind moa --tli 4"; fi
  OMP_NUM_THREADS=2 "$PY" -m tether.server.cli train-drafter --target runs/medium --data data/corpus-pkgs \
    --device "$DEVICE" --out runs/drafters/$n --steps "$DRAFTER_STEPS" --batch-size "$DRAFT_BATCH" --seq-len 256 \
    --eval-every 400 --save-every 600 $F > drafter-$n.log 2>&1 &
done
wait
for n in moa4 eagle; do [ -f runs/drafters/$n/drafter_config.json ] || fail "drafter $n" drafter-$n.log; done
stamp pack
bash "$SCRIPT" pack || fail pack /dev/null
stamp end
echo DONE
EOF
  (cd "$WORK" && WORK=$WORK SCRIPT=$SCRIPT setsid nohup bash pipeline.sh > log 2>&1 < /dev/null &)
  echo "pipeline started in $WORK"
  ;&  # and poll in the same call
poll)
  set +e  # a log not written yet is no error
  while [ $SECONDS -lt "$POLL_S" ] && ! grep -q '^DONE' "$WORK/log" 2>/dev/null; do sleep 5; done
  echo "=== log"; cat "$WORK/log"
  for f in target.log drafter-moa4.log drafter-eagle.log; do
    [ -f "$WORK/$f" ] && { echo "=== $f"; tail -c 500 "$WORK/$f"; echo; }
  done
  if grep -q '^PARTS' "$WORK/log" && [ -n "${OUT:-}" ]; then ship 1; fi  # the call that sees the end brings 1-4
  ;;
pack)  # in $WORK, once both drafters are trained: the weights -> weights.tar.xz in parts, and its checksum
  cd "$WORK" || exit 1
  M=runs/medium
  files=("$M/config.json" "$M/model.safetensors" "$M/tokenizer.json" "$M/summary.json" "$M/history.json")
  for n in moa4 eagle; do
    for f in drafter_config.json drafter.safetensors summary.json history.json; do files+=("runs/drafters/$n/$f"); done
  done
  set -o pipefail
  tar -cf - "${files[@]}" | xz -T0 -6 > weights.tar.xz || exit 1
  rm -f part-*
  split -b "$PART_BYTES" -d -a 2 weights.tar.xz part-
  sha256sum weights.tar.xz > weights.sha256
  echo "PARTS $(find . -maxdepth 1 -name 'part-*' | wc -l), $(stat -c %s weights.tar.xz) bytes"
  ;;
ship)
  ship "${2:?ship N}"
  ;;
join)
  shift
  mkdir -p runs/86m
  # parts in name order, whichever folder each came back in
  mapfile -t parts < <(for d in "$@"; do printf '%s\n' "$d"/part-*; done | awk -F/ '{print $NF, $0}' | sort |
    cut -d' ' -f2-)
  cat "${parts[@]}" > runs/86m/weights.tar.xz
  sum=$(cut -d' ' -f1 "$1/weights.sha256")
  echo "$sum  runs/86m/weights.tar.xz" | sha256sum -c || exit 1
  xz -dc runs/86m/weights.tar.xz | tar -xf - -C runs/86m --strip-components=1 && rm runs/86m/weights.tar.xz
  ls -R runs/86m
  ;;
*)
  echo "usage: $0 start | poll | pack | ship N | join DIR..." >&2
  exit 2
  ;;
esac
