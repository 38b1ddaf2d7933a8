#!/bin/bash
set -e
grep -rl ref-O9CI /app/notes > /app/answer.txt
