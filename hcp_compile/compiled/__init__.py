"""The compiled door: the ``hcp`` torch.compile backend, which runs the rewrite of
``hcp_compile.passes`` and hands the graph to the inner compiler, the graph variants it keeps
per kind of batch, and the ops the rewrite inserts (docs/compiled-path.md)."""
