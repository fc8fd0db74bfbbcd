"""The scheduling path: what a request's prompt is made of, which chunk KV it shares, where each
block lives and when it is evicted. No tensors; the worker side never imports from here except
the plain data types it receives."""
