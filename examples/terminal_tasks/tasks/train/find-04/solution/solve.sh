#!/bin/bash
set -e
find /app/notes -name banana.txt > /app/answer.txt
