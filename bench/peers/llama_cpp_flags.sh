# Sourced by build_llama_server.sh and install_llama_cpp_python.sh: the CMake flags both give
# llama.cpp. AVX2 + FMA + AVX-512 (F, VBMI, VNNI, BF16) with AMX off, not -march=native: on
# some virtual machines a native build crashes in the AMX path. Say so beside any figure
# measured with them.
LLAMA_CPP_CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
