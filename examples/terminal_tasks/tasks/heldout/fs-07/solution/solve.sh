#!/bin/bash
set -e
mkdir -p /app/backup
cp /app/data/report.txt /app/backup/report.txt
