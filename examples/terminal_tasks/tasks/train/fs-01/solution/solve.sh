#!/bin/bash
set -e
mkdir -p /app/var/run
