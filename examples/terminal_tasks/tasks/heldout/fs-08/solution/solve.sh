#!/bin/bash
set -e
chmod +x /app/scripts/run.sh
