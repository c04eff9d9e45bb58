#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, transformers, rich, jinja2,
# safetensors, tokenizers, anyio, click, prometheus-client, but no fastapi/uvicorn/pydantic/
# llguidance, nor flash-linear-attention's fla-core and einops) into .whl/ (git-ignored via the
# repository's info/exclude), for `device run --carry .whl`.
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
for p in /.whl/ /.old/ /gpu-out/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
mkdir -p .whl
plat=()
for n in 17 24 27 28 31 34 35 39; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64)
rm -f .whl/*.whl
for pkg in fastapi starlette pydantic pydantic-core uvicorn h11 annotated-types typing-inspection \
           annotated-doc opentelemetry-api typing-extensions llguidance gguf fla-core einops; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
ls -la .whl && du -sh .whl
