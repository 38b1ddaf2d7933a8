#!/bin/bash
set -e
sort -u /app/words.txt > /app/unique.txt
