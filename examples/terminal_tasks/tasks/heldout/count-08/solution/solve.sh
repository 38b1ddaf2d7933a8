#!/bin/bash
set -e
grep -c WARN /app/log.txt > /app/answer.txt
