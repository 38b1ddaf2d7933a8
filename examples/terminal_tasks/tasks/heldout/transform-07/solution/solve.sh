#!/bin/bash
set -e
sed -i 's/kiwi/fig/g' /app/words.txt
