#!/bin/bash
set -e
echo 'agent' > /app/owner.txt
