#!/bin/bash
set -e
printf '[main]\nworkers = 2\nlog_level = debug\n' > /app/server.ini
