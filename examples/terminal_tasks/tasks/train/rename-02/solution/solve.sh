#!/bin/bash
set -e
cd /app/files && for f in *.txt; do mv "$f" "${f%.txt}.md"; done
