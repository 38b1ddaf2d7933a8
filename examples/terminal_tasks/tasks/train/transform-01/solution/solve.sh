#!/bin/bash
set -e
sed -i 's/camel/plum/g' /app/words.txt
