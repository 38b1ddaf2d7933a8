#!/bin/bash
set -e
grep -c ERROR /app/log.txt > /app/answer.txt
