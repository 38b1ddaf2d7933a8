#!/bin/bash
set -e
grep -rl ref-9RGH /app/notes > /app/answer.txt
