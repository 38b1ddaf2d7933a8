#!/bin/bash
# Verifier of count-02: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(tr -d '[:space:]' < /app/answer.txt | tr -s /)" = "7" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
