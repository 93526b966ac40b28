"""The node agent's shared parts: its protocol, the wrapper's client, and who calls it.

The agent itself (``jupyter_ext.nodeagent``, docs/agent.md) runs CRIU for user pods at
Pod Security "baseline"; these modules hold no Jupyter imports, so the kernel wrapper
(:mod:`.client`) and the agent (:mod:`.protocol`, :mod:`.peers`) share them.
"""
