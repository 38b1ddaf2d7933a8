#!/bin/bash
set -e
find /app/notes -name tiger.txt > /app/answer.txt
