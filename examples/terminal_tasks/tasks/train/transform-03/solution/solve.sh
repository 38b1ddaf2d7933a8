#!/bin/bash
set -e
sed -i 's/gecko/lemon/g' /app/words.txt
