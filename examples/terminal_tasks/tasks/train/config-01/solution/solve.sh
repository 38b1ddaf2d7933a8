#!/bin/bash
set -e
printf '[main]\nport = 8443\ndebug = false\n' > /app/app.ini
