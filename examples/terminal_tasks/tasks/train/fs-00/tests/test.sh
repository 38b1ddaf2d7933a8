#!/bin/bash
# Verifier of fs-00: reward 1 when the task is done, else 0.
mkdir -p /logs/verifier
if [ -z "$(find /app/cache -name '*.tmp')" ] && [ -f /app/cache/pear.dat ] && [ -f /app/cache/mango.dat ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
