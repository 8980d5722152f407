"""Training (tether.server.train): the corpus and the two training programs, apart from serving.

- corpus.py: the training corpus (stdlib and permissive packages' sources, a held-out split, a byte-level BPE);
  package_sources.py decides which installed packages may go in.
- target.py: `train_target`, a target model from a preset; attention.py: its "flex" attention backend.
- drafter.py: `train_drafter`, a MoA or EAGLE drafter against a frozen target.
- commands.py: `tether-server build-corpus`, `train-target` and `train-drafter` (tether.server.cli lists them).

Serving never imports this package (tests/test_import_graph.py); it imports serving's pieces it trains against
(the in-process speculative engine for held-out acceptance, the default model folders).
"""
