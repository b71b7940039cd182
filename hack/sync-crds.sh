#!/usr/bin/env bash
# Copy the PromptCache CRD (source of truth: crds/) into the Helm chart. tests/operator/test_operator_consistency.py fails
# when the two differ.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cp "$root/crds/promptcache.io_promptcaches.yaml" "$root/charts/promptcache-operator/crds/promptcache.io_promptcaches.yaml"
echo "synced charts/promptcache-operator/crds/promptcache.io_promptcaches.yaml"
