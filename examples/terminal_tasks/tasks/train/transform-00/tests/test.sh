#!/bin/bash
# Verifier of transform-00: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(cat /app/names.txt)" = "$(cat /tests/expected.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
