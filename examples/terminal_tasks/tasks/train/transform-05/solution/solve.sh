#!/bin/bash
set -e
sort /app/words.txt > /app/sorted.txt
