#!/bin/bash
set -e
sed -i 's/fig/kiwi/g' /app/words.txt
