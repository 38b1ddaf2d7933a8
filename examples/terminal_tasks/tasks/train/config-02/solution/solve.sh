#!/bin/bash
set -e
printf '[server]\ntimeout = 60\nworkers = 7\n' > /app/app.ini
