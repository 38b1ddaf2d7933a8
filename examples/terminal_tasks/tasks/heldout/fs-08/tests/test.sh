#!/bin/bash
# Verifier of fs-08: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ -x /app/scripts/run.sh ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
