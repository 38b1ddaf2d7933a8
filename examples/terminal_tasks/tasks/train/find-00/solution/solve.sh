#!/bin/bash
set -e
find /app/notes -name whale.txt > /app/answer.txt
