#!/bin/bash
set -e
head -n 3 /app/words.txt > /app/top.txt
