#!/bin/bash
set -e
grep -c upload /app/log.txt > /app/answer.txt
