#!/bin/sh
# tether-client in a container: `generate` and `chat` draft with onnxruntime and cache in /var/cache/tether.
# argparse keeps the last value of a repeated flag, so the defaults go first and any --backend / --cache-dir
# on the command line wins. TETHER_BACKEND and TETHER_CACHE_DIR change the defaults.
set -eu
case "${1:-}" in
    generate | chat)
        command="$1"
        shift
        exec tether-client "${command}" --backend "${TETHER_BACKEND:-onnx}" \
            --cache-dir "${TETHER_CACHE_DIR:-/var/cache/tether}" "$@"
        ;;
    *)
        exec tether-client "$@"
        ;;
esac
