#!/bin/bash
# Verifier of rename-02: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(cd /app/files && find . -type f | LC_ALL=C sort)" = "$(cat /tests/expected.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
