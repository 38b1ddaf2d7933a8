#!/bin/sh
echo done
