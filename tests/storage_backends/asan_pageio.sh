#!/usr/bin/env bash
# Run the C extension's tests and the file backend's tests against an AddressSanitizer build
# of storage_backends/_pageio.c, then put the normal build back.
#
#     bash tests/storage_backends/asan_pageio.sh [extra pytest arguments]
#
# From the repository root, with gcc. The extension is rebuilt in place with
# -fsanitize=address; Python itself is not instrumented, so libasan is preloaded (it must be
# the first runtime loaded) and leak checking is off (the interpreter's own allocations at
# exit are not leaks of ours). Any ASan report fails the run: ASan aborts the process.
set -euo pipefail
cd "$(dirname "$0")/../.."
log="$(mktemp)"
build() { python setup.py build_ext --inplace --force -q >"$log" 2>&1 || { cat "$log"; exit 1; }; }
trap 'build; rm -f "$log"' EXIT
CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" LDFLAGS="-fsanitize=address" build
export LD_PRELOAD="$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
python -c "from storage_backends import native; assert native.pageio, 'ASan build did not import'"
python -m pytest -q -p no:cacheprovider \
    tests/storage_backends/test_pageio.py tests/storage_backends/test_file_store.py \
    tests/storage_backends/test_objects.py "$@"
