#!/bin/bash
# scripts/gpu_check.py on a bare, offline GPU machine that takes the checkout plus a few carried files
# per call (how it ran on a lent H100 on 2026-11-24). State lives in $GPU_STATE and is reused while the
# machine stays up, so calls can be chained: the first builds, the next ones run steps.
#
# Prepare a carry folder (git-ignored, e.g. .gpu/) here (scripts/gpu_prebuild.sh does it with a prebuilt
# CUDA build instead of the source tarball, which saves the build there):
#   tar -C third_party --exclude=llama.cpp/.git --exclude='llama.cpp/models/*.gguf' --exclude=llama.cpp/docs \
#       --exclude=llama.cpp/media --exclude=llama.cpp/benches -cJf .gpu/llama.tar.xz llama.cpp   # ~9 MB
#   split -b 50M MODEL.gguf .gpu/base.          # base.aa, base.ab (one part per call if needed;
#                                                 BASE_PARTS=N there when not 2)
#   python scripts/gguf_delta.py make MODEL.gguf CONVERTED.gguf .gpu/pre.delta   # ~2 MB for --prerope-k
#   (the text: WikiText-2 test, shipped in pykvq/texts/)
# There:  bash scripts/gpu_bare.sh SECONDS [step,step,...] [gpu_check args...]
# A full CUDA build (sm_90) took 390-410 s on 16 cores; results and logs go to $OUT as one tarball.
set -u
export PYTHONUNBUFFERED=1
BUDGET=$1; shift; STEPS=${1:-}; shift || true
T0=$(date +%s)
W=${GPU_STATE:-/tmp/pykvq-gpu}; mkdir -p $W/parts $W/out
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for f in .gpu*/base.* .gpu*/pre.delta.* .gpu*/wiki.txt; do [ -e "$f" ] && cp "$f" $W/parts/; done
[ -e $W/parts/wiki.txt ] || xz -dc pykvq/texts/wiki.test.raw.xz > $W/parts/wiki.txt   # the shipped WikiText-2 test
if ls .gpu*/llama.tar.xz >/dev/null 2>&1; then   # the sources, to build there
  [ -e $W/llama.cpp/.pykvq-stamp ] || tar -xJf .gpu*/llama.tar.xz -C $W || exit 1
  rm -rf third_party/llama.cpp; ln -s $W/llama.cpp third_party/llama.cpp
fi
if [ ! -e $W/base.gguf ] && ls $W/parts/base.* >/dev/null 2>&1; then
  n_parts=$(ls $W/parts/base.* | wc -l); [ "${BASE_PARTS:-2}" = "$n_parts" ] && cat $W/parts/base.* > $W/base.gguf
fi
if [ ! -e $W/pre.gguf ] && [ -e $W/base.gguf ] && [ -e $W/parts/pre.delta.bin ]; then
  python3 scripts/gguf_delta.py apply $W/base.gguf $W/parts/pre.delta $W/pre.gguf
fi
# a CUDA build made elsewhere (scripts/gpu_prebuild.sh) saves the ~400 s build: its bin/ and the libraries it needs
if [ ! -e $W/build.done ] && ls .gpu*/build-cuda.tar.xz >/dev/null 2>&1; then
  mkdir -p $W/build-cuda && tar -xJf .gpu*/build-cuda.tar.xz -C $W/build-cuda && touch $W/build.done
  echo "prebuilt CUDA binaries unpacked at $(( $(date +%s) - T0 )) s"
fi
# cuBLAS from the machine's CUDA (or its PyTorch wheels); the carried libgomp etc. only as a last resort
CUBLAS=$(find /usr/local/cuda*/ /opt -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$W/build-cuda/bin${CUBLAS:+:$(dirname $CUBLAS)}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$W/build-cuda/fallback-lib
if [ ! -e $W/build.done ]; then
  [ -e $W/build-cuda/CMakeCache.txt ] || cmake -S . -B $W/build-cuda -DCMAKE_BUILD_TYPE=Release -DPYKVQ_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DPYKVQ_BACKEND_OPS=ON > $W/out/cfg.txt 2>&1 || { tail -30 $W/out/cfg.txt; exit 1; }
  timeout $(left) cmake --build $W/build-cuda -j "$(nproc)" --target pykvq test-backend-ops > $W/out/build.txt 2>&1 && touch $W/build.done
  tail -2 $W/out/build.txt; echo "build at $(( $(date +%s) - T0 )) s"
fi
if [ -e $W/build.done ]; then
  for s in ${STEPS//,/ }; do
    [ -e $W/out/gpu_check-$s.json ] && { echo "step $s already done"; continue; }
    [ "$(left)" -gt 15 ] || break
    PRE=(); [ -e $W/pre.gguf ] && PRE=(--prerope-model $W/pre.gguf)
    timeout $(left) python3 scripts/gpu_check.py --steps $s --build $W/build-cuda --out $W/out \
        --model $W/base.gguf --bench-model $W/base.gguf --text $W/parts/wiki.txt "${PRE[@]}" "$@" 2>&1 | tee $W/out/log-$s.txt
    [ -e $W/out/gpu_check.json ] && mv $W/out/gpu_check.json $W/out/gpu_check-$s.json
  done
fi
[ -n "${OUT:-}" ] && tar -czf $OUT/gpu.tar.gz -C $W/out --exclude='*.bin' .
echo "elapsed $(( $(date +%s) - T0 )) s"
