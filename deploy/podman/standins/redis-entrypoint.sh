#!/bin/sh
# The redis:7 stand-in's entrypoint (deploy/podman/stack.sh). The official image builds
# Redis with protected mode off, since a container is reached from other containers,
# never from its own loopback; Debian's Redis keeps it on, and would then refuse every
# client of the compose network. Turn it off the same way, before the caller's options
# (after a config file, when the first argument names one), so theirs still win.
set -e
if [ "${1:-}" = redis-server ]; then
  shift
  case "${1:-}" in
    ""|-*) set -- redis-server --protected-mode no "$@" ;;
    *) config=$1; shift; set -- redis-server "$config" --protected-mode no "$@" ;;
  esac
fi
exec "$@"
