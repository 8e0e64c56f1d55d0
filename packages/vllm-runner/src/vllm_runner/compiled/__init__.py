"""Serving programs inside vLLM's compiled model: taps (a custom op at a declared location),
what runs in the graph from buffers (saves, steering), steps planned per program, and full CUDA
graphs broken and replayed at the taps.

Pure torch over the runtime's plain data; no vLLM import. Internal.
"""
