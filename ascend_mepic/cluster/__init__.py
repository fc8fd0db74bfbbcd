"""Several MEPIC replicas behind one address, routed by the chunks each replica holds.

Every router in use (vllm-router's ``kv_aware`` and ``cache_aware``, Dynamo's KV router, llm-d's
prefix scorer) scores a replica by how much of a prompt it holds *from token 0*, so a document
chunk in the middle of a prompt is invisible to them. MEPIC publishes each resident chunk as a
root chain keyed by the chunk's own tokens (``core/chunk_events.py``); Dynamo's standalone KV
indexer (``python -m dynamo.indexer``, ai-dynamo-runtime) already keeps those chains per worker
and answers "which worker holds how many tokens of this token sequence" over HTTP. What this
package adds is the adapter between the two:

* ``indexer``: the HTTP client of Dynamo's indexer (query, register, unregister) and its
  command line;
* ``request_chunks``: a request's prefix and chunks, in the tokens the replica will see;
* ``policy``: round robin, prefix-aware (the indexer's overlap of the whole prompt from token 0,
  what a prefix router scores) and chunk-aware (the tokens a replica holds over every chunk and
  the prefix, with a short chunk -> replica affinity for chunks whose events have not arrived),
  all under one bounded-load rule;
* ``front``: the HTTP front that asks the policy, forwards the request to the replica, watches
  replica health and keeps the indexer's worker set in step with it.

docs/cluster.md says how to deploy it and what it does not do.
"""
