"""kiln.engine: engine backends behind one contract (base.py), served over one API (server.py).

Importing the package registers every backend; backend modules import their heavy libraries
inside functions, so this stays fast.
"""

from kiln.engine import ctranslate2, hf_torch, openvino, remote, tensorrt_llm  # noqa: F401  (registers the backends)
from kiln.engine.llama_cpp import backend as _llama_cpp  # noqa: F401  (registers the llama_cpp backend)
