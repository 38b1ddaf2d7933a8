#!/bin/bash
set -e
mkdir -p /app/out/reports
