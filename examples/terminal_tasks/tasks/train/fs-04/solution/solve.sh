#!/bin/bash
set -e
echo 'hello world' > /app/hello.txt
