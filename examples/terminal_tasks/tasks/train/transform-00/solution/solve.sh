#!/bin/bash
set -e
tail -n +2 /app/people.csv | cut -d, -f1 > /app/names.txt
