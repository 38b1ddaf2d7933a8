#!/bin/bash
set -e
grep -c cache /app/log.txt > /app/answer.txt
