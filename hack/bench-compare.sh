#!/usr/bin/env bash
# Same-run comparison of the throughput and latency benchmarks between a base commit and the working tree:
#   hack/bench-compare.sh [BASE=HEAD~1] [OUT=bench-results/compare]
# The base is checked out into a temporary worktree that reuses this checkout's virtualenv for its third-party
# packages; the two trees' benchmarks then run alternately (base, here, base, here) so that both see the same
# machine load. Tables land in OUT/{base,here}-{1,2}-{throughput,latency}.md.
set -euo pipefail
base=${1:-HEAD~1}
out=${2:-bench-results/compare}
here=$(pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the benchmarks run from two trees
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/base" "$base"
python3.11 -m venv --without-pip "$tmp/base/.venv"
echo "$here/.venv/lib/python3.11/site-packages" > "$tmp/base/.venv/lib/python3.11/site-packages/zz-here.pth"
(cd "$tmp/base" && .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e . > /dev/null)
args=(--transports "${BENCH_TRANSPORTS:-tcp,bulk-tcp,bulk-unix}" --sizes-mb "${BENCH_SIZES:-4,32}" --repeats "${BENCH_REPEATS:-5}")
for round in 1 2; do
  for side in base here; do
    dir=$([ "$side" = base ] && echo "$tmp/base" || echo "$here")
    echo "== $side, round $round" >&2
    (cd "$dir" && .venv/bin/promptcache bench throughput "${args[@]}" --output "$out/$side-$round-throughput.md" > /dev/null)
    (cd "$dir" && .venv/bin/promptcache bench latency --rounds "${BENCH_ROUNDS:-200}" > "$out/$side-$round-latency.md")
  done
done
echo "tables in $out/" >&2
