#!/bin/bash
set -e
grep -rl ref-HKXS /app/notes > /app/answer.txt
