# Included at llama.cpp's project() call by `make llama-cpp` (CMAKE_PROJECT_llama.cpp_INCLUDE).
# llama-cpp-python forces LLAMA_BUILD_COMMON on, yet its Python package loads only libllama and
# libggml*: llama.cpp's common library (52 of the build's 140 steps, half its compile time, and
# not in the wheel) is skipped by shadowing the cached option with a directory-scope variable.
set(LLAMA_BUILD_COMMON OFF)
