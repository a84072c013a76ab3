#!/usr/bin/env bash
# What CI does, by hand: clone this repository fresh at COMMIT and run `CI=true bash .ci/run`;
# the log goes to $OUT/NAME.log and one summary line (rc, wall time, load) to $OUT/summary.txt.
# usage: scripts/fresh_clone_ci.sh NAME COMMIT      (OUT defaults to /tmp)
# Issue 10's five runs were made with it, two at a time, while the machine was busy.
set -u
name=$1; commit=$2; out=${OUT:-/tmp}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
d=$out/clone-$name; rm -rf "$d"
git clone -q "$repo" "$d" && cd "$d" && git checkout -q "$commit" || exit 2
start=$(date +%s)
CI=true bash .ci/run > "$out/$name.log" 2>&1
rc=$?
end=$(date +%s)
result=$(grep -E "passed|failed" "$out/$name.log" | tail -1)
echo "$name commit=$commit rc=$rc wall=$((end-start))s start=$(date -d @"$start" +%T) load=$(cut -d' ' -f1-3 /proc/loadavg) :: $result" >> "$out/summary.txt"
