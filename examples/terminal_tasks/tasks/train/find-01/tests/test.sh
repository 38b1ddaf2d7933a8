#!/bin/bash
# Verifier of find-01: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ "$(tr -d '[:space:]' < /app/answer.txt | tr -s /)" = "/app/notes/misc/raven.txt" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
