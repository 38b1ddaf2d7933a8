#!/bin/bash
set -e
cd /app/files && for f in *.log; do mv "$f" "old_$f"; done
