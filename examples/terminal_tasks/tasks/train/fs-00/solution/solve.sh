#!/bin/bash
set -e
rm /app/cache/*.tmp
