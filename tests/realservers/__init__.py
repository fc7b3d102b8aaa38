"""iop in front of real OpenAI-compatible servers nobody here wrote (llama-cpp-python's
server, LiteLLM's proxy), each request compared sent directly and through iop."""
