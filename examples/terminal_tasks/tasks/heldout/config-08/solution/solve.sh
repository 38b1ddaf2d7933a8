#!/bin/bash
set -e
printf 'DEBUG=false\nHOST=example.org\n' > /app/app.env
