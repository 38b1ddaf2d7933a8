#!/bin/bash
set -e
grep -rl ref-6L5R /app/notes > /app/answer.txt
