# Sourced by build_llama_server.sh: the CMake flags it gives
# llama.cpp. AVX2 + FMA, plus AVX-512 (F, VBMI, VNNI, BF16) where this CPU has all four, with
# AMX off, not -march=native: on some virtual machines a native build crashes in the AMX
# path. An AVX-512 build on a CPU without it stops at its first AVX-512 instruction (illegal
# instruction), so the flags follow this machine's /proc/cpuinfo: build on the machine that
# runs the benchmark. Say which beside any figure measured with them.
LLAMA_CPP_AVX512=OFF
if grep -qw avx512f /proc/cpuinfo && grep -qw avx512vbmi /proc/cpuinfo \
  && grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx512_bf16 /proc/cpuinfo; then
  LLAMA_CPP_AVX512=ON
fi
LLAMA_CPP_CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=$LLAMA_CPP_AVX512 -DGGML_AVX512_VBMI=$LLAMA_CPP_AVX512
  -DGGML_AVX512_VNNI=$LLAMA_CPP_AVX512 -DGGML_AVX512_BF16=$LLAMA_CPP_AVX512
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
echo "llama.cpp CPU flags: AVX2 + FMA, AVX-512 $LLAMA_CPP_AVX512, AMX off" >&2
