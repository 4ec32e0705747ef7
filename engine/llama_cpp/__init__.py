"""The llama_cpp backend: config, the library and server runtimes, the C binding, scoring."""
