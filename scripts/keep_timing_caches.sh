#!/bin/bash
# Keeps the TensorRT timing caches of a lease's archive (e20.tgz or s21.tgz, as a poll brought it back) for the next
# lease on the same kind of GPU: into .carry/timing/<GPU name>/, which that lease's start call carries
# (scripts/box_lease_lib.sh: timing_caches_in). Run from the repository root: bash scripts/keep_timing_caches.sh TGZ
set -e
[ $# = 1 ] && [ -f "$1" ] || { echo "usage: bash scripts/keep_timing_caches.sh LEASE.tgz" >&2; exit 2; }
unpacked=$(mktemp -d); trap 'rm -rf "$unpacked"' EXIT
tar -xzf "$1" -C "$unpacked" --wildcards '*/gpu-name.txt' '*/timing-*.cache' 2>/dev/null \
  || { echo "keep_timing_caches: $1 holds no timing caches with their GPU's name" >&2; exit 1; }
gpu=$(cat "$unpacked"/*/gpu-name.txt)
mkdir -p ".carry/timing/$gpu"
cp "$unpacked"/*/timing-*.cache ".carry/timing/$gpu/"
ls -l ".carry/timing/$gpu"
