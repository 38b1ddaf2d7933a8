#!/bin/bash
set -e
echo '{"host": "localhost", "debug": false}' > /app/settings.json
