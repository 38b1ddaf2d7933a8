#!/bin/bash
set -e
printf '[app]\ndebug = false\nname = web\n' > /app/service.ini
