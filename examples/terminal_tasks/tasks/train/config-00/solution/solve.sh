#!/bin/bash
set -e
printf 'TIMEOUT=30\nHOST=0.0.0.0\n' > /app/app.env
