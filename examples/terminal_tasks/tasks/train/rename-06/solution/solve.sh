#!/bin/bash
set -e
cd /app/files && for f in *.csv; do mv "$f" "${f%.csv}.bak"; done
