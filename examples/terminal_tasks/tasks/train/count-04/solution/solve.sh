#!/bin/bash
set -e
grep -c search /app/log.txt > /app/answer.txt
