#!/bin/bash
set -e
sed -i 's/return s\[-1\]/return s[0]/' /app/mathlib.py
