"""The worker's engine-agnostic core: each step's plan, the hooks it needs, serving ops on a
request's own rows, tensor-parallel pieces, the logit lens, edited attention patterns.

Takes plain data from an engine adapter (`engine`): a step's layout and its requests. No vLLM
import. Internal.
"""
