#!/bin/bash
# Verifier of config-00: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if python3 /tests/test_task.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
