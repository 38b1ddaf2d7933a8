#!/bin/bash
set -e
echo '{"name": "api", "debug": false}' > /app/settings.json
