#!/bin/bash
set -e
tail -n 3 /app/words.txt > /app/bottom.txt
