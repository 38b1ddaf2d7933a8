#!/bin/bash
set -e
echo '{"debug": false, "log_level": "debug"}' > /app/app.json
