#!/bin/bash
set -e
grep -c billing /app/log.txt > /app/answer.txt
