#!/bin/bash
set -e
find /app/notes -name koala.txt > /app/answer.txt
