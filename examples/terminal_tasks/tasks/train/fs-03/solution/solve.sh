#!/bin/bash
set -e
ln -s /app/releases/v2 /app/current
