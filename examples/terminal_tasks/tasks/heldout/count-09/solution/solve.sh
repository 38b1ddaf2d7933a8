#!/bin/bash
set -e
grep -c INFO /app/log.txt > /app/answer.txt
