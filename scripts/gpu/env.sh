# Sourced by the scripts/gpu/* device scripts: points CMake and pkg-config at the Debian packages
# scripts/gpu/fetch-build-deps unpacked into .cache/gpu-deps (the GPU machine lacks their headers;
# docs/design.md §9), and keeps NVLink multicast off (device README).
deps="$PWD/.cache/gpu-deps/root"
if [ ! -f "$deps/.complete" ]; then
  echo "scripts/gpu: .cache/gpu-deps missing: run scripts/gpu/fetch-build-deps here and carry .cache/gpu-deps" >&2
  exit 1
fi
export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}:/usr/lib/x86_64-linux-gnu/pkgconfig:/usr/share/pkgconfig"
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! command -v pkg-config >/dev/null; then
  export PKG_CONFIG_EXECUTABLE="$deps/usr/bin/pkgconf"
  export PATH="$deps/usr/bin:$PATH"
  ln -sf pkgconf "$deps/usr/bin/pkg-config" 2>/dev/null || true
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
