#!/bin/sh
# Init container of the node pods with node.modelDownload.files: fetch each model into the models
# volume and check its SHA-256 before the node sees it. A file already there with the right sum is
# kept (a restarted pod downloads nothing); a download whose sum differs is deleted and the pod
# fails to start, saying both sums. MODELS: one "SHA256 PATH URL" line per model; MODELS_DIR: where
# the models volume is mounted.
set -eu
dir=${MODELS_DIR:-/models}
echo "$MODELS" | while read -r sum path url; do
  [ -n "$sum" ] || continue
  dest="$dir/$path"
  mkdir -p "$(dirname "$dest")"
  if [ -s "$dest" ] && [ "$(sha256sum "$dest" | cut -d' ' -f1)" = "$sum" ]; then
    echo "model $path: present, sha256 ok"
    continue
  fi
  echo "model $path: downloading $url"
  rm -f "$dest.part"
  curl -fsSL --retry 5 --retry-delay 2 -o "$dest.part" "$url"
  got=$(sha256sum "$dest.part" | cut -d' ' -f1)
  if [ "$got" != "$sum" ]; then
    rm -f "$dest.part"
    echo "model $path: sha256 $got, expected $sum (node.modelDownload.files): refused" >&2
    exit 1
  fi
  mv "$dest.part" "$dest"
  echo "model $path: sha256 ok"
done
