#!/bin/bash
set -e
mkdir -p /app/build/logs
