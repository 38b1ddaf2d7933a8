#!/bin/bash
set -e
sed -i 's/return c \* 9 \/ 5 - 32/return c * 9 \/ 5 + 32/' /app/mathlib.py
