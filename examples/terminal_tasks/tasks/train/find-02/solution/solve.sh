#!/bin/bash
set -e
grep -rl ref-7XVT /app/notes > /app/answer.txt
