#!/bin/bash
set -e
sed -i 's/grape/banana/g' /app/words.txt
