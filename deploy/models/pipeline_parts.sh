# shellcheck shell=bash
# The parts that the GPU-host pipelines (medium/pipeline.sh, compact/pipeline.sh) share, sourced by both: the
# install on a bare host, the corpus's unpacking, waiting for the background pipeline, and the weights' way back
# (packed into xz parts small enough for the device tool's 16 MiB a file and 64 MiB a call, then joined here).
# Each function reads WORK (the pipeline's folder) and, as needed, PY, SCRIPT, POLL_S, PART_BYTES and OUT.
POLL_S=${POLL_S:-540}
PART_BYTES=${PART_BYTES:-16700000}  # four of them and the checksum stay under 64 MiB, each under 16 MiB

prepare_host() {  # $1: the carried corpus, $2: where it goes; makes $WORK, installs, unpacks and checks the corpus
  mkdir -p "$WORK"
  install_tether
  if [ -d "$WORK/corpus" ]; then  # earlier calls staged part of it: this call's part joins them
    stage_corpus "$1"
    unpack_corpus "$WORK/corpus" "$2"
  else
    unpack_corpus "$1" "$2"
  fi
}

stage_host() {  # a call ahead of `start` when the corpus is too large for one: installs, adds $1's files to the
  mkdir -p "$WORK"  # staged corpus
  install_tether
  stage_corpus "$1"
}

stage_corpus() {  # $1: a call's carried corpus folder (files at any depth, or absent); its files join $WORK/corpus
  mkdir -p "$WORK/corpus"
  if [ -d "$1" ]; then find "$1" -type f -exec cp {} "$WORK/corpus/" \;; fi
  ls -l "$WORK/corpus"
}

launch() {  # stdin: the training stages; run in $WORK between stamp() and fail() and `$SCRIPT pack`, in a session
  {           # of their own
    cat <<'EOF'
export PYTHONPATH=/tmp/site-t:/tmp/site PYTHONUNBUFFERED=1
stamp() { echo "STAGE $1 $(date +%s) $(date -u +%T)"; }
fail() { echo "FAIL $1"; tail -30 "$2"; echo DONE; exit 1; }
EOF
    cat
    cat <<'EOF'
stamp pack
bash "$SCRIPT" pack || fail pack /dev/null
stamp end
echo DONE
EOF
  } > "$WORK/pipeline.sh"
  (cd "$WORK" && WORK=$WORK SCRIPT=$SCRIPT setsid nohup bash pipeline.sh > log 2>&1 < /dev/null &)
  echo "pipeline started in $WORK"
}

install_tether() {  # tether and zstandard importable by $PY: from .whl's wheels and this checkout, if missing (an
  # earlier call's install, /tmp/site*, counts)
  if ! PYTHONPATH=/tmp/site-t:/tmp/site "$PY" -c 'import tether.server.cli, zstandard' 2>/dev/null; then
    if [ -d .whl ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-t . >/dev/null
  fi
  export PYTHONPATH=/tmp/site-t:/tmp/site
  "$PY" -c 'import tether.server.cli, zstandard'
}

unpack_corpus() {  # $1: the carried corpus (tokenizer.json, manifest.json, {train,val}.bin.xz, SHA256SUMS), $2: to;
  # a .bin.xz may come split (`split -d`: train.bin.xz.00, train.bin.xz.01, ...), its pieces joined in name order
  local s
  mkdir -p "$2" && cp "$1/tokenizer.json" "$2"/
  for s in train val; do cat "$1/$s.bin.xz"* | xz -dc -T0 > "$2/$s.bin"; done
  cp "$1/manifest.json" "$2"/
  (cd "$2" && sha256sum -c --quiet "$1/SHA256SUMS")
  echo "corpus checked"
}

wait_for_done() {  # up to POLL_S seconds from the call's start, for the log's DONE; then the log and $@'s ends
  local f
  set +e  # a log not written yet is no error
  while [ $SECONDS -lt "$POLL_S" ] && ! grep -q '^DONE' "$WORK/log" 2>/dev/null; do sleep 5; done
  echo "=== log"; cat "$WORK/log"
  for f in "$@"; do
    [ -f "$WORK/$f" ] && { echo "=== $f"; tail -c 500 "$WORK/$f"; echo; }
  done
  if grep -q '^PARTS' "$WORK/log" && [ -n "${OUT:-}" ]; then ship_parts 1; fi  # the call that sees the end brings 1-4
}

pack_parts() {  # in $WORK: the files named -> weights.tar.xz in parts of PART_BYTES, and its checksum
  cd "$WORK" || return 1
  set -o pipefail
  tar -cf - "$@" | xz -T0 -6 > weights.tar.xz || return 1
  rm -f part-*
  split -b "$PART_BYTES" -d -a 2 weights.tar.xz part-
  sha256sum weights.tar.xz > weights.sha256
  echo "PARTS $(find . -maxdepth 1 -name 'part-*' | wc -l), $(stat -c %s weights.tar.xz) bytes"
}

ship_parts() {  # parts 4N-3..4N and the checksum into $OUT
  local all parts p
  mapfile -t all < <(cd "$WORK" && printf '%s\n' part-*)
  parts=("${all[@]:$(( ($1 - 1) * 4 )):4}")
  [ ${#parts[@]} -gt 0 ] && [ -f "$WORK/${parts[0]}" ] || { echo "no part $1"; exit 1; }
  for p in "${parts[@]}"; do cp "$WORK/$p" "$OUT/"; done
  cp "$WORK/weights.sha256" "$OUT/"
  echo "shipped ${parts[*]} of ${#all[@]}"
}

join_parts() {  # $1: where to unpack, $2: leading path components to strip, then the folders the parts came back in
  local dest=$1 strip=$2 sum parts
  shift 2
  mkdir -p "$dest"
  # parts in name order, whichever folder each came back in
  mapfile -t parts < <(for d in "$@"; do printf '%s\n' "$d"/part-*; done | awk -F/ '{print $NF, $0}' | sort |
    cut -d' ' -f2-)
  cat "${parts[@]}" > "$dest/weights.tar.xz"
  sum=$(cut -d' ' -f1 "$1/weights.sha256")  # every folder holds the same checksum
  echo "$sum  $dest/weights.tar.xz" | sha256sum -c || exit 1
  xz -dc "$dest/weights.tar.xz" | tar -xf - -C "$dest" --strip-components="$strip" && rm "$dest/weights.tar.xz"
  ls -R "$dest"
}
