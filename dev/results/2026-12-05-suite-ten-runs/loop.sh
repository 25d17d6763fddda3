#!/usr/bin/env bash
cd /tmp/flake  # a fresh clone of the repository
for i in $(seq 1 10); do
  t0=$(date +%s)
  CI=true bash .ci/run > /tmp/flake_run_$i.log 2>&1; rc=$?
  t1=$(date +%s)
  echo "run $i rc=$rc seconds=$((t1 - t0)) $(grep -E '[0-9]+ passed' /tmp/flake_run_$i.log | tail -1)" >> /tmp/flake_summary.txt
done
echo done >> /tmp/flake_summary.txt
