#!/bin/bash
# Verifier of fs-07: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if cmp -s /app/data/report.txt /app/backup/report.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
