"""The only code that reads vLLM's private state: the worker classes handed to vLLM, one adapter
per vLLM model runner (`v1_runner`, `v2_runner`), attaching them (`attach`), the releases they
were checked against (`compat`), and the client's calls into the workers (`rpc`,
`vllm_client`).

Supporting a new vLLM release is a change here (see docs/vllm-releases.md). Internal.
"""
