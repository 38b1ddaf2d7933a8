#!/bin/bash
set -e
sed -i 's/return x + x/return x * x/' /app/mathlib.py
