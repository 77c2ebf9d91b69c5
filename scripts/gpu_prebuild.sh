#!/bin/bash
# Build the CUDA binaries HERE (nvcc, no GPU needed) and pack what a lent GPU machine needs into carry folders,
# so that the loan's minutes go to measuring instead of the ~400 s build (scripts/gpu_bare.sh unpacks them).
#
#   bash scripts/gpu_prebuild.sh [MODEL.gguf] [PRE-ROPE.gguf]     # defaults: SmolLM2 and its --prerope-k file
#
# Then, on the device, one call per folder (a call carries <= 64 MiB; each right after the last, while the machine
# is warm, since the state lives in /tmp there; the build is ~45 MB, SmolLM2 Q4_1 98 MB: three calls):
#   carry .gpu1:  BASE_PARTS=3 bash scripts/gpu_bare.sh 280 ops                      (timeout_s 300)
#   carry .gpu2:  BASE_PARTS=3 bash scripts/gpu_bare.sh 280 perf,ncu                 (timeout_s 300)
#   carry .gpu3:  BASE_PARTS=3 bash scripts/gpu_bare.sh 540 prerope,bench,kld --reps 2 \
#                     --settings f16,q8_0,q4_0,bfp4_32,nuq4,nuq3o,q8_0/nuq4             (timeout_s 580)
# The machine goes back 30 s after a call ends: start each call at once. ~50 min here cold (2 cores), ~8 with ccache.
#
# This machine has CUDA's compiler and runtime but neither cuBLAS nor a driver: cuBLAS comes from its pinned
# wheel (third_party/cuda_headers.py) and libcuda.so.1 is a link-time stub of the few driver calls ggml-cuda
# makes; neither travels (the GPU machine has the real ones).
set -eu
cd "$(dirname "$0")/.."
PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
MODEL=${1:-$HOME/.cache/pykvq/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PRE=${2:-}
B=build-cuda
INC=$($PY third_party/cuda_headers.py)
LIB=$($PY third_party/cuda_headers.py --libs)

mkdir -p $B/stub
grep -rhoE '\bcu[A-Z][A-Za-z0-9]+\(' third_party/llama.cpp/ggml/src/ggml-cuda native/ggml/cuda | tr -d '(' \
    | grep -v '^cuBLAS$' | sort -u | sed 's/.*/int &(void) { return 999; }/' > $B/stub/cuda_stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o $B/stub/libcuda.so.1 $B/stub/cuda_stub.c
ln -sf libcuda.so.1 $B/stub/libcuda.so    # the linker finds libggml-cuda's NEEDED libcuda.so.1 beside it

cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DPYKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} \
    -DPYKVQ_BACKEND_OPS=ON -DCUDA_cublas_LIBRARY=$LIB/libcublas.so -DCUDA_cublasLt_LIBRARY=$LIB/libcublasLt.so \
    -DCUDA_cuda_driver_LIBRARY=$(pwd)/$B/stub/libcuda.so "-DCMAKE_CUDA_FLAGS=-I$INC" "-DCMAKE_CXX_FLAGS=-I$INC" >/dev/null
cmake --build $B -j "$(nproc)" --target llama llama-completion llama-perplexity llama-bench test-backend-ops

# the binaries, stripped, plus the OpenMP runtime in case the GPU machine's image lacks it
rm -rf $B/pack && mkdir -p $B/pack/bin $B/pack/fallback-lib
cp $B/bin/*.so $B/pack/bin/    # unversioned sonames (CMakeLists.txt); older builds left .so.0* files beside them
cp $B/bin/{llama-completion,llama-perplexity,llama-bench,test-backend-ops} $B/pack/bin/
strip --strip-unneeded $B/pack/bin/* 2>/dev/null || true
cp -L "$(gcc -print-file-name=libgomp.so.1)" $B/pack/fallback-lib/
rm -rf .gpu[0-9]* && mkdir -p .gpu1
tar -C $B/pack -cJf .gpu1/build-cuda.tar.xz bin fallback-lib

# the model in parts that fill each call's carry (the build first), then the pre-RoPE file as a delta against it
# (the text travels in the tree)
if [ -z "$PRE" ]; then
  PRE=$B/pre.gguf
  # calibration runs the model in pykvq's runtime: the CPU build's, else this CUDA build's on the CPU (the driver
  # stub fails CUDA's initialisation, so ggml finds no device). f16 window rows: CUDA's kernels hold f16 rows, so the
  # check's CPU and GPU runs read the same window
  if [ -e build/bin/libllama.so ]; then
    $PY convert/to_gguf.py "$MODEL" -o "$PRE" --prerope-k --kv-window-type f16 --no-progress
  else
    PYKVQ_LIB=$(pwd)/$B/bin/libllama.so LD_LIBRARY_PATH=$(pwd)/$B/stub:$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
        $PY convert/to_gguf.py "$MODEL" -o "$PRE" --prerope-k --kv-window-type f16 --no-progress
  fi
fi
CAP=$(( 60*1024*1024 ))       # a call carries 64 MiB, the tree (~3 MB) included
size=$(stat -c %s "$MODEL"); off=0; n=1
room=$(( CAP - $(stat -c %s .gpu1/build-cuda.tar.xz) ))
[ $room -gt 0 ] || { n=2; room=$CAP; }
while [ $off -lt $size ]; do
  mkdir -p .gpu$n
  tail -c +$(( off + 1 )) "$MODEL" | head -c $room > .gpu$n/base.$n     # gpu_bare.sh cats base.* in order
  off=$(( off + room )); n=$(( n + 1 )); room=$CAP
done
n=$(( n - 1 ))
$PY scripts/gguf_delta.py make "$MODEL" "$PRE" .gpu$n/pre.delta
du -sh .gpu*
echo "$n calls: carry .gpu1 ... .gpu$n, one per call, each started right after the last (BASE_PARTS=$n)"
