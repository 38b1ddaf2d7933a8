#!/bin/bash
set -e
echo 'ready' > /app/status.txt
