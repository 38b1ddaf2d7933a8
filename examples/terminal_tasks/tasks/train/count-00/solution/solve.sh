#!/bin/bash
set -e
wc -l < /app/log.txt > /app/answer.txt
