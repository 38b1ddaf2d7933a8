#!/bin/bash
set -e
sed -i 's/return n < 0/return n > 0/' /app/mathlib.py
