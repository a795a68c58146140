#!/usr/bin/env bash
# A digest of the library's source (s4w_core/ and integrations/ *.py), to name the tree a device run
# used: the device machine's copy of .git can lag the working tree it was sent, so `git rev-parse
# HEAD` there may name an older commit. The device scripts print this digest into env.txt; run
#   bash benchmarks/tree_digest.sh REV
# here to get the digest of commit REV (without REV: of the working tree) and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
digest() { find s4w_core integrations -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16; }
if [ $# -ge 1 ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  git archive "$1" s4w_core integrations | tar -x -C "$tmp"
  (cd "$tmp" && digest)
else
  digest
fi
