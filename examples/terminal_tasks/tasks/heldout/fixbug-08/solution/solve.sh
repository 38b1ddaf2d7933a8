#!/bin/bash
set -e
sed -i 's/return w + h/return w * h/' /app/utils.py
