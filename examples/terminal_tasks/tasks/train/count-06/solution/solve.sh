#!/bin/bash
set -e
grep -c mailer /app/log.txt > /app/answer.txt
