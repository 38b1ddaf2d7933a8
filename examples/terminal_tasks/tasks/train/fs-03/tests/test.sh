#!/bin/bash
# Verifier of fs-03: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ -L /app/current ] && [ "$(readlink -f /app/current)" = /app/releases/v2 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
