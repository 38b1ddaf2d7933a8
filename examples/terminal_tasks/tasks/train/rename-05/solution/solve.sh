#!/bin/bash
set -e
cd /app/files && for f in *.txt; do mv "$f" "old_$f"; done
