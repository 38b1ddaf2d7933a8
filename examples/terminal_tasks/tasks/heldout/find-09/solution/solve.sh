#!/bin/bash
set -e
find /app/notes -name heron.txt > /app/answer.txt
