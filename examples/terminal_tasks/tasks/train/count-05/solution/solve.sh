#!/bin/bash
set -e
grep -c DEBUG /app/log.txt > /app/answer.txt
