#!/bin/bash
set -e
sed -i 's/return len(s)/return len(s.split())/' /app/utils.py
