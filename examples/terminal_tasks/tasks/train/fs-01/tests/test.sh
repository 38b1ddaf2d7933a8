#!/bin/bash
# Verifier of fs-01: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ -d /app/var/run ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
