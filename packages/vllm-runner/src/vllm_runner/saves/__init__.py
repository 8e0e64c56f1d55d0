"""Saved values, from the forward to the client: the per-worker store, the device arena for
saves at graph taps, copies to the host, shared-memory files, and the wire format across
processes.

Pure torch and plain data; no vLLM import. Internal.
"""
