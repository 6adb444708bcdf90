#!/bin/sh
# The image's entry point. No arguments, or flags only: `tandem serve` with those flags (the
# TANDEM_* environment and the config file fill in the rest). Anything else runs as given,
# e.g. `docker run -it tandem bash`. exec: the server is the process `docker stop` signals.
set -e
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- tandem serve "$@"
fi
exec "$@"
