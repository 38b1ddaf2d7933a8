#!/bin/bash
set -e
echo '{"name": "api", "timeout": 10}' > /app/app.json
