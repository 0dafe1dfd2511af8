"""The HTTP server: OpenAI- and Ollama-compatible endpoints over a continuous-batching scheduler.

    python -m ktransformers.server --gguf_path M.gguf [--port 10002]   (pip install -e ".[server]")
"""
