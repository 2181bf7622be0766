# Sourced by the H200 scripts: the GPU machine has no network, so the peers and this
# package's own dependencies it lacks come as wheels in .whl/ (carried with the tree;
# see docs/performance.md for the download command) and go into /tmp/site.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
else
  echo "no .whl/ here: peers and libraries that are not installed will be missing" >&2
fi
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
